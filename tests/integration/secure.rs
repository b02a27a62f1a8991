//! Secure connections: NATS with a token, with a user and password, over TLS with a client
//! certificate; PostgreSQL over TLS through the URL. Each against a server of the test's own.

use inventory_benches::db;
use inventory_infra::jetstream::{self, NatsSecurity, Topology};
use inventory_tests::nats::{NatsServer, unique_names};
use inventory_tests::pg_server::PostgresServer;
use inventory_tests::tls::TestCerts;
use std::os::unix::fs::PermissionsExt as _;

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};

/// Connects with `security` and creates streams: the whole path serve takes at start-up.
async fn jetstream_works(url: &str, security: &NatsSecurity) -> Result<(), String> {
    let client =
        jetstream::connect_with(url, "inventory secure test", security, Default::default())
            .await
            .map_err(|error| error.to_string())?;
    let names = unique_names("secure");
    let topology = Topology {
        stream: names.stream,
        subject_prefix: names.subject_prefix,
        dlq_stream: names.dlq_stream,
        dlq_subject_prefix: names.dlq_subject_prefix,
        events_stream: names.events_stream,
        events_subject_prefix: names.events_subject_prefix,
        ..Topology::default()
    };
    jetstream::ensure_streams(&jetstream::context(client), &topology)
        .await
        .map(|_| ())
        .map_err(|error| error.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_with_a_token() {
    let server = NatsServer::start_with_args(&["--auth", "t0ken-for-test"]).await;
    let refused = jetstream_works(&server.url(), &NatsSecurity::default()).await;
    assert!(refused.is_err(), "connected without the token");
    let wrong = NatsSecurity {
        token: Some("not-it".into()),
        ..NatsSecurity::default()
    };
    assert!(jetstream_works(&server.url(), &wrong).await.is_err());
    let right = NatsSecurity {
        token: Some("t0ken-for-test".into()),
        ..NatsSecurity::default()
    };
    jetstream_works(&server.url(), &right).await.unwrap();
    // The token in the URL, as nats://<token>@host.
    let in_url = server.url().replace("nats://", "nats://t0ken-for-test@");
    jetstream_works(&in_url, &NatsSecurity::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_with_a_user_and_password() {
    let server = NatsServer::start_with_args(&["--user", "inventory", "--pass", "pa55word"]).await;
    let with = |password: &str| NatsSecurity {
        user: Some("inventory".into()),
        password: Some(password.into()),
        ..NatsSecurity::default()
    };
    let refused = jetstream_works(&server.url(), &with("wrong"))
        .await
        .unwrap_err();
    assert!(
        !refused.contains("wrong"),
        "the password leaked into: {refused}"
    );
    jetstream_works(&server.url(), &with("pa55word"))
        .await
        .unwrap();
    let in_url = server
        .url()
        .replace("nats://", "nats://inventory:pa55word@");
    jetstream_works(&in_url, &NatsSecurity::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_a_client_certificate() {
    let certs = TestCerts::generate();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_owned();
    let server = NatsServer::start_with_args(&[
        "--tlsverify",
        "--tlscert",
        &path(&certs.server_cert),
        "--tlskey",
        &path(&certs.server_key),
        "--tlscacert",
        &path(&certs.ca),
    ])
    .await;
    let trusted = NatsSecurity {
        tls_ca: Some(certs.ca.clone()),
        require_tls: true,
        ..NatsSecurity::default()
    };
    // The server asks for a client certificate: trusting its CA is not enough.
    assert!(jetstream_works(&server.url(), &trusted).await.is_err());
    // A client that does not trust the test CA refuses the server's certificate.
    let untrusting = NatsSecurity {
        tls_client_cert: Some((certs.client_cert.clone(), certs.client_key.clone())),
        require_tls: true,
        ..NatsSecurity::default()
    };
    assert!(jetstream_works(&server.url(), &untrusting).await.is_err());
    let full = NatsSecurity {
        tls_client_cert: Some((certs.client_cert.clone(), certs.client_key.clone())),
        ..trusted
    };
    jetstream_works(&server.url(), &full).await.unwrap();
}

async fn uses_tls(conn: &DatabaseConnection) -> bool {
    let row = conn
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get("", "ssl").unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_through_the_url() {
    let server = PostgresServer::start().await;
    let certs = TestCerts::generate();
    let admin = db::connect(&server.url(), 1).await.unwrap();
    let data_dir: String = admin
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SHOW data_directory",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get("", "data_directory")
        .unwrap();
    // PostgreSQL reads its key only if the server's user owns it and no one else may read it.
    for (from, name) in [
        (&certs.server_cert, "server.crt"),
        (&certs.server_key, "server.key"),
    ] {
        let to = std::path::Path::new(&data_dir).join(name);
        std::fs::copy(from, &to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)).unwrap();
        if nix::unistd::geteuid().is_root() {
            let user = nix::unistd::User::from_name("postgres").unwrap().unwrap();
            nix::unistd::chown(&to, Some(user.uid), Some(user.gid)).unwrap();
        }
    }
    for statement in [
        "ALTER SYSTEM SET ssl = on",
        "ALTER SYSTEM SET ssl_cert_file = 'server.crt'",
        "ALTER SYSTEM SET ssl_key_file = 'server.key'",
        "SELECT pg_reload_conf()",
    ] {
        admin.execute_unprepared(statement).await.unwrap();
    }

    let verified = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        server.url(),
        certs.ca.display()
    );
    // The reload is asynchronous: wait until a verified TLS connection goes through.
    let mut conn = None;
    for _ in 0..100 {
        if let Ok(c) = db::connect(&verified, 1).await {
            conn = Some(c);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let conn = conn.expect("a TLS connection verified against the test CA");
    assert!(uses_tls(&conn).await);

    // Without a TLS setting, the driver's default (prefer): TLS, since the server offers it.
    let unsaid = db::connect(&server.url(), 1).await.unwrap();
    assert!(uses_tls(&unsaid).await, "no TLS setting turned TLS off");
    // Both of the driver's spellings are honoured; only an explicit disable turns it off.
    for (spelling, tls) in [
        ("sslmode=require", true),
        ("ssl-mode=require", true),
        ("sslmode=disable", false),
    ] {
        let conn = db::connect(&format!("{}?{spelling}", server.url()), 1)
            .await
            .unwrap();
        assert_eq!(uses_tls(&conn).await, tls, "{spelling}");
    }

    // verify-full without the CA: the server's certificate is not trusted.
    let unverified = format!("{}?sslmode=verify-full", server.url());
    assert!(db::connect(&unverified, 1).await.is_err());
}
