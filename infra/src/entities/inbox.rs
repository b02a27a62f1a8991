use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "inbox")]
pub(crate) struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub(crate) message_id: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub(crate) consumer: String,
    pub(crate) received_at: DateTimeUtc,
    pub(crate) completed_at: Option<DateTimeUtc>,
    pub(crate) payload_hash: String,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
