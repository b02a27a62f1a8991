use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "outbox")]
pub(crate) struct Model {
    #[sea_orm(primary_key)]
    pub(crate) seq: i64,
    #[sea_orm(unique)]
    pub(crate) event_id: Uuid,
    pub(crate) relay_partition: i16,
    pub(crate) order_id: Uuid,
    pub(crate) subject: String,
    #[sea_orm(column_type = "Text")]
    pub(crate) payload: String,
    pub(crate) created_at: DateTimeUtc,
    pub(crate) parked_at: Option<DateTimeUtc>,
    #[sea_orm(column_type = "Text", nullable)]
    pub(crate) parked_reason: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
