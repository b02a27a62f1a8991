use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "partition_owner")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub partition_id: i16,
    pub shard: String,
    pub epoch: i64,
    pub state: String,
    pub changed_at: DateTimeWithTimeZone,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
