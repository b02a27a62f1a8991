//! A shard's HA pair on this one machine, for a person to try what docs/deploying.md ("With
//! Patroni") describes: etcd, two Patroni nodes each with its PostgreSQL, synchronous
//! replication, and HAProxy in front following the leader. It is the pair the slow tier's
//! Patroni tests start (`inventory_tests::patroni`), held until Ctrl-C, which stops all of it.
//! `scripts/patroni-pair.sh` installs what it needs and runs it.

use inventory_tests::patroni::PatroniPair;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let pair = PatroniPair::start().await;
    let leader = pair.leader().await.unwrap_or("none yet");
    println!(
        "ready in {:.1} s; leader {leader}",
        pair.time_to_ready().as_secs_f64()
    );
    println!("through HAProxy (follows the leader): {}", pair.url());
    for node in ["node_a", "node_b"] {
        println!("{node}, bypassing HAProxy: {}", pair.node_url(node));
    }
    println!("Ctrl-C stops the pair.");
    tokio::signal::ctrl_c().await?;
    Ok(())
}
