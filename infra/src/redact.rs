//! Keeping secrets out of logs and error messages.

use url::Url;

/// `scheme://user:password@host/…?password=…` with the user information and the value of every
/// secret parameter (`password`, `sslpassword`, `token`: the drivers take a password there too)
/// masked; other text unchanged. A comma-separated list of URLs (a NATS cluster) has each one
/// masked. What does not parse as a URL is masked whole: it could be anything.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(",")
}

/// Query parameters whose value is a secret, whatever their case.
const SECRET_PARAMETERS: [&str; 3] = ["password", "sslpassword", "token"];

fn is_secret(parameter: &str) -> bool {
    SECRET_PARAMETERS
        .iter()
        .any(|secret| parameter.eq_ignore_ascii_case(secret))
}

fn redact_one(text: &str) -> String {
    let Ok(mut url) = Url::parse(text) else {
        return "***".to_owned();
    };
    if !url.username().is_empty() || url.password().is_some() {
        // Both fail only for a URL without a host, which has no user information either.
        let _ = url.set_password(None);
        let _ = url.set_username("***");
    }
    if url.query_pairs().any(|(name, _)| is_secret(&name)) {
        let masked: Vec<(String, String)> = url
            .query_pairs()
            .map(|(name, value)| {
                let value = if is_secret(&name) {
                    "***".into()
                } else {
                    value
                };
                (name.into_owned(), value.into_owned())
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(masked);
    }
    url.into()
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn user_information_is_masked() {
        assert_eq!(
            redact_url("postgres://inventory:s3cret@db:5432/stock?sslmode=require"),
            "postgres://***@db:5432/stock?sslmode=require"
        );
        assert_eq!(
            redact_url("nats://token@127.0.0.1:4222"),
            "nats://***@127.0.0.1:4222"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            redact_url("nats://a:1@n1:4222,nats://b:2@n2:4222"),
            "nats://***@n1:4222,nats://***@n2:4222"
        );
        assert_eq!(
            redact_url("sqlite://inventory.db?mode=rwc"),
            "sqlite://inventory.db?mode=rwc"
        );
    }

    #[test]
    fn secret_parameters_are_masked_in_any_case() {
        assert_eq!(
            redact_url("postgres://inventory@db/stock?sslmode=require&password=s3cret"),
            "postgres://***@db/stock?sslmode=require&password=***"
        );
        assert_eq!(
            redact_url("postgres://u:p@db/stock?PASSWORD=s3cret&sslpassword=k3y#x"),
            "postgres://***@db/stock?PASSWORD=***&sslpassword=***#x"
        );
        assert_eq!(
            redact_url("postgres://db/stock?application_name=password"),
            "postgres://db/stock?application_name=password"
        );
    }

    #[test]
    fn what_is_not_a_url_is_masked_whole() {
        assert_eq!(redact_url("postgres://u:s3cret@exa mple/stock"), "***");
    }
}
