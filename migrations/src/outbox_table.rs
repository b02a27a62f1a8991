//! The shape of an outbox table, shared by Inventory's `outbox` and the orders producer's
//! `orders_outbox`: one relay publishes either.

use sea_orm_migration::{prelude::*, schema::*};

/// Creates the outbox table `table` and the index the relay reads it by.
pub(crate) async fn create(manager: &SchemaManager<'_>, table: &str) -> Result<(), DbErr> {
    manager
        .create_table(
            Table::create()
                .table(Alias::new(table))
                .if_not_exists()
                // Write order. Not commit order across orders: the relay reads every row left,
                // never "after the last seen", so a row that commits late is not skipped. Within
                // one order it is commit order, as long as every transaction writing an order's
                // events first locks that order (the natural key's `lock_order`, the orders
                // producer's row).
                .col(big_pk_auto(Outbox::Seq))
                .col(uuid_uniq(Outbox::EventId))
                .col(small_integer(Outbox::RelayPartition))
                .col(uuid(Outbox::OrderId))
                // Below the stream's prefix: `stock.reserved` goes to `inventory.stock.reserved`.
                .col(string_len(Outbox::Subject, 200))
                .col(text(Outbox::Payload))
                .col(timestamp_with_time_zone(Outbox::CreatedAt))
                // Set when the relay gave up on the row (too large, no stream for its subject):
                // it waits for an operator, and blocks only its own order.
                .col(timestamp_with_time_zone_null(Outbox::ParkedAt))
                .col(text_null(Outbox::ParkedReason))
                .to_owned(),
        )
        .await?;
    // A relay reads the partitions it holds, oldest first.
    manager
        .create_index(
            Index::create()
                .name(format!("idx_{table}_partition_seq"))
                .table(Alias::new(table))
                .if_not_exists()
                .col(Outbox::RelayPartition)
                .col(Outbox::Seq)
                .to_owned(),
        )
        .await
}

pub(crate) async fn drop(manager: &SchemaManager<'_>, table: &str) -> Result<(), DbErr> {
    manager
        .drop_table(Table::drop().table(Alias::new(table)).to_owned())
        .await
}

#[derive(DeriveIden)]
enum Outbox {
    Seq,
    EventId,
    RelayPartition,
    OrderId,
    Subject,
    Payload,
    CreatedAt,
    ParkedAt,
    ParkedReason,
}
