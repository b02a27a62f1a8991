use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "stock_reservations")]
pub(crate) struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub(crate) order_id: Uuid,
    #[sea_orm(primary_key, auto_increment = false)]
    pub(crate) book_id: Uuid,
    pub(crate) quantity: i32,
    pub(crate) status: String,
    pub(crate) message_id: String,
    pub(crate) created_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
