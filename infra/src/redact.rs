//! Keeping secrets out of logs and error messages.

/// `scheme://user:password@host/…?password=…` with the user information and the value of every
/// secret parameter (`password`, `sslpassword`, `token`: the drivers take a password there too)
/// masked; other text unchanged. A comma-separated list of URLs (a NATS cluster) has each one
/// masked.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(",")
}

/// Query parameters whose value is a secret, whatever their case.
const SECRET_PARAMETERS: [&str; 3] = ["password", "sslpassword", "token"];

fn redact_one(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|at| at + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let masked = match rest[..authority_end].rfind('@') {
        Some(at) => format!("{}***@{}", &url[..scheme_end], &rest[at + 1..]),
        None => url.to_owned(),
    };
    redact_query(&masked)
}

fn redact_query(url: &str) -> String {
    let Some((head, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _))
                if SECRET_PARAMETERS
                    .iter()
                    .any(|secret| name.eq_ignore_ascii_case(secret)) =>
            {
                format!("{name}=***")
            }
            _ => pair.to_owned(),
        })
        .collect();
    let mut out = format!("{head}?{}", pairs.join("&"));
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
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
}
