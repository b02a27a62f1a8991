//! `cargo run -p natural-key-example` consumes until ctrl-c; `… -- publish` sends a few orders.
//! The whole example is in `lib.rs`, so that a test can run it in-process.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = natural_key_example::Config::from_env();
    match std::env::args().nth(1).as_deref() {
        Some("publish") => natural_key_example::publish(&config).await,
        _ => natural_key_example::run(&config, tokio::signal::ctrl_c()).await,
    }
}
