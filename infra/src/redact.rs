//! Keeping secrets out of logs and error messages.

/// `scheme://user:password@host/…` with the user information masked; other text unchanged. A
/// comma-separated list of URLs (a NATS cluster) has each one masked.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(",")
}

fn redact_one(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|at| at + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{}***@{}", &url[..scheme_end], &rest[at + 1..]),
        None => url.to_owned(),
    }
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
}
