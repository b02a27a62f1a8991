//! The producer's publish, against a real server: where no stream takes the subject, the
//! error says so, after the retries with the same message id.

use async_nats::jetstream::context::PublishErrorKind;
use bytes::Bytes;
use inventory_benches::publish::{OrderPublisher, PublishFailed};
use inventory_domain::EventKind;
use inventory_infra::jetstream;
use inventory_tests::nats::{shared_url, unique_names};

#[tokio::test]
async fn publishing_where_no_stream_listens_is_stream_not_found() {
    let client = jetstream::connect(&shared_url().await, "publisher test")
        .await
        .expect("a NATS server (set NATS_URL)");
    // Names of its own, and no stream made for them.
    let topology = unique_names("nowhere").topology();
    let publisher = OrderPublisher::new(jetstream::context(client), topology.clone());
    let error = publisher
        .publish_raw(
            &topology.subject(EventKind::Placed),
            "m-1",
            Bytes::from_static(b"{}"),
        )
        .await
        .expect_err("no stream holds the subject");
    assert!(
        matches!(&error, PublishFailed::Nats { source, .. } if source.kind() == PublishErrorKind::StreamNotFound),
        "{error}"
    );
}
