//! A move's actions on the two shards' databases: the statements behind [`Action`]'s fence,
//! copy, drain, activation, removal, unfence and drop. Each is conditional on the owner row the
//! move left (its state and epoch), read under a lock in the action's own transaction, so a
//! repeat, or a late action of a mover that lost, finds the row moved on and changes nothing:
//! [`RowsError::Refused`] says what it found.
//!
//! A partition's rows are those of its books: the books of the shard's `stock_items`,
//! `stock_reservations` and `line_cancellations` whose `partition_of` is the partition. Stock
//! is sharded by book, so nothing else a decision reads belongs to a partition, except an
//! order's cancellation made before the stream was sharded (`order_states`), which is copied
//! beside the reservations of its order and never removed.
//!
//! [`Action`]: super::Action

use std::num::NonZeroU32;
use std::time::Duration;

use chrono::{DateTime, FixedOffset};
use inventory_domain::BookId;
use inventory_domain::shard::partition_of;
use sea_orm::DatabaseConnection;
use sea_orm::sqlx::{self, Connection as _, PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use super::{OwnerRow, OwnerState, books_out_of_balance};

/// What a move's statement found where it expected what the move left.
#[derive(Debug, thiserror::Error)]
pub enum RowsError {
    /// The owner row is not what the action is conditional on: a repeat of an action that
    /// moved it on, or the world changed. Nothing was written.
    #[error("{0}")]
    Refused(String),
    /// The copy read books whose `reserved` is not their reservations' sum; nothing copied.
    #[error("books out of balance on the old shard, nothing copied: {0:?}")]
    OutOfBalance(Vec<Uuid>),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// What the old shard's outbox still holds of the partition: the drain waits for none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unpublished {
    pub rows: u64,
    /// Rows the relay parked: they wait for an operator (`inventory outbox retry`), and the
    /// drain with them.
    pub parked: u64,
    /// The oldest parked row's reason.
    pub parked_reason: Option<String>,
}

/// How many rows of each table a copy or a removal moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moved {
    pub books: usize,
    pub reservations: usize,
    pub line_cancellations: usize,
}

/// One shard's database, as a move reads and writes it (PostgreSQL: a shard is one).
#[derive(Clone)]
pub struct ShardRows {
    pool: PgPool,
    partitions: NonZeroU32,
}

/// The transaction-level lock a copy and a drop take on the new shard, on the partition: a copy
/// that read the old shard's rows before an abort's unfence commits before the drop, or
/// reads again after it and is refused. `hashtext('inventory shard move')`, for the reader.
const MOVE_LOCK: i32 = 1_265_079_457;

/// The books a shard's database holds any row of. A shard holds far more reservations than
/// books: their distinct books are read one index descent each (a loose scan of the index by
/// book, migration 15), never by reading every reservation.
const BOOKS_SQL: &str = "\
WITH RECURSIVE reserved_books AS (
    (SELECT book_id FROM stock_reservations ORDER BY book_id LIMIT 1)
    UNION ALL
    SELECT (SELECT r.book_id FROM stock_reservations r WHERE r.book_id > b.book_id
            ORDER BY r.book_id LIMIT 1)
    FROM reserved_books b WHERE b.book_id IS NOT NULL
)
SELECT book_id FROM stock_items
UNION SELECT book_id FROM reserved_books WHERE book_id IS NOT NULL
UNION SELECT book_id FROM line_cancellations";

const OWNER_SQL: &str = "SELECT epoch, state FROM partition_owner WHERE partition_id = $1";

/// [`OWNER_SQL`], the row locked for the rest of the transaction.
const LOCKED_OWNER_SQL: &str =
    "SELECT epoch, state FROM partition_owner WHERE partition_id = $1 FOR UPDATE";

/// The fence's locks: the partition's stock rows, in book order, as every statement takes them.
const LOCK_BOOKS_SQL: &str =
    "SELECT book_id FROM stock_items WHERE book_id = ANY($1) ORDER BY book_id FOR UPDATE";

/// The owner row changes a move makes, each from what the move left ($2, the epoch it left)
/// to the row it wants ($3, the epoch after), for [`change_owner`]. The fence: `active` to
/// `fenced`.
const FENCE_SQL: &str = "\
UPDATE partition_owner SET state = 'fenced', epoch = $3, changed_at = now()
WHERE partition_id = $1 AND epoch = $2 AND state = 'active'";

/// The activation on the new shard: `incoming` to `active`.
const ACTIVATE_SQL: &str = "\
UPDATE partition_owner SET state = 'active', epoch = $3, changed_at = now()
WHERE partition_id = $1 AND epoch = $2 AND state = 'incoming'";

/// An abort's unfence on the old shard: `fenced`, or still `active` when the abort came before
/// the fence, to `active` at the next epoch.
const UNFENCE_SQL: &str = "\
UPDATE partition_owner SET state = 'active', epoch = $3, changed_at = now()
WHERE partition_id = $1 AND epoch = $2 AND state IN ('fenced', 'active')";

/// Sessions idle in a transaction for longer than $2 that block the session $1, directly or
/// through the sessions waiting between them: a statement queued for a row lock ahead of the
/// fence is what `pg_blocking_pids` names for the fence, not the idle holder it waits for.
const IDLE_BLOCKERS_SQL: &str = "\
WITH RECURSIVE blockers(pid) AS (
    SELECT unnest(pg_blocking_pids($1))
  UNION
    SELECT unnest(pg_blocking_pids(blockers.pid)) FROM blockers
)
SELECT pid FROM pg_stat_activity
WHERE pid IN (SELECT pid FROM blockers)
  AND state IN ('idle in transaction', 'idle in transaction (aborted)')
  AND state_change < now() - $2 * interval '1 millisecond'";

impl ShardRows {
    /// The database of `db`, a shard of an orders stream of `partitions` partitions.
    pub fn new(db: &DatabaseConnection, partitions: NonZeroU32) -> Self {
        Self {
            pool: db.get_postgres_connection_pool().clone(),
            partitions,
        }
    }

    /// The partition's owner row here, if any.
    pub async fn owner(&self, partition: u32) -> Result<Option<OwnerRow>, RowsError> {
        let mut connection = self.pool.acquire().await?;
        owner_row(&mut connection, partition, OWNER_SQL).await
    }

    /// The shard names this database's owner rows give, other than `shard`: a database that
    /// is another shard's.
    pub async fn other_names(&self, shard: &str) -> Result<Vec<String>, RowsError> {
        Ok(sqlx::query_scalar(
            "SELECT DISTINCT shard FROM partition_owner WHERE shard <> $1 ORDER BY shard",
        )
        .bind(shard)
        .fetch_all(&self.pool)
        .await?)
    }

    /// The fence: the partition's stock rows locked in book order, which waits for the
    /// statements that hold them, then its owner row `fenced` if `active` at `epoch`. A session
    /// idle in a transaction that blocks it for longer than `idle_grace` is terminated (a
    /// client stopped mid-transaction would otherwise hold the move forever). Statements that
    /// queued behind the locks read the owner row after them: not owned.
    pub async fn fence(
        &self,
        partition: u32,
        epoch: i64,
        idle_grace: Duration,
    ) -> Result<(), RowsError> {
        self.ending_idle_blockers("the fence", idle_grace, async |connection| {
            let mut txn = connection.begin().await?;
            no_statement_timeout(&mut txn).await?;
            let books = self.books(&mut txn, partition).await?;
            sqlx::query(LOCK_BOOKS_SQL)
                .bind(&books)
                .execute(&mut *txn)
                .await?;
            let fenced = OwnerRow {
                epoch,
                state: OwnerState::Fenced,
            };
            change_owner(&mut txn, FENCE_SQL, partition, epoch, fenced, "fence").await?;
            txn.commit().await?;
            Ok(())
        })
        .await
    }

    /// Runs `work` (`what`, for the log) on a connection of its own, terminating each session
    /// idle in a transaction that has blocked it for longer than `idle_grace`, checked every
    /// half second: a client stopped mid-transaction would otherwise hold the move for ever.
    async fn ending_idle_blockers<T>(
        &self,
        what: &str,
        idle_grace: Duration,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, RowsError>,
    ) -> Result<T, RowsError> {
        let mut connection = self.pool.acquire().await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *connection)
            .await?;
        let work = work(&mut connection);
        tokio::pin!(work);
        let mut watch = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = watch.tick() => self.end_idle_blockers(what, pid, idle_grace).await?,
            }
        }
    }

    async fn end_idle_blockers(
        &self,
        what: &str,
        pid: i32,
        grace: Duration,
    ) -> Result<(), RowsError> {
        let idle: Vec<i32> = sqlx::query_scalar(IDLE_BLOCKERS_SQL)
            .bind(pid)
            .bind(f64::from(
                u32::try_from(grace.as_millis()).unwrap_or(u32::MAX),
            ))
            .fetch_all(&self.pool)
            .await?;
        for blocker in idle {
            tracing::warn!(
                pid = blocker,
                ?grace,
                "a session idle in a transaction blocks {what}: terminating it"
            );
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(blocker)
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }

    /// What the outbox still holds of the partition's events.
    pub async fn unpublished(&self, partition: u32) -> Result<Unpublished, RowsError> {
        let (rows, parked, parked_reason): (i64, i64, Option<String>) = sqlx::query_as(
            "SELECT count(*), count(parked_at), \
                    (array_agg(parked_reason ORDER BY seq) \
                        FILTER (WHERE parked_at IS NOT NULL))[1] \
             FROM outbox WHERE shard_partition = $1",
        )
        .bind(partition_id(partition)?)
        .fetch_one(&self.pool)
        .await?;
        Ok(Unpublished {
            rows: u64::try_from(rows).unwrap_or_default(),
            parked: u64::try_from(parked).unwrap_or_default(),
            parked_reason,
        })
    }

    /// The copy, into this (the new) shard's database from `old`, in one transaction here:
    /// refused where the partition is `active` here, or unless `old`'s owner row is `fenced`
    /// at `epoch`; what an earlier attempt left deleted, the rows inserted and checked, the
    /// owner row `incoming` at `new_epoch` as `shard`.
    pub async fn copy_from(
        &self,
        old: &Self,
        partition: u32,
        (epoch, new_epoch): (i64, i64),
        shard: &str,
    ) -> Result<Moved, RowsError> {
        let mut connection = self.pool.acquire().await?;
        let mut txn = connection.begin().await?;
        no_statement_timeout(&mut txn).await?;
        // The owner row locked until the copy commits: an activation (which takes no move
        // lock) that came in between the check and the owner row's upsert below would be undone
        // by it.
        lock_unless_active(&mut txn, partition, "the copy").await?;
        let rows = old.read_fenced(partition, epoch).await?;
        let mut stale = self.books(&mut txn, partition).await?;
        stale.extend(rows.stock.iter().map(|stock| stock.0));
        delete_books(&mut txn, &stale).await?;
        insert(&mut txn, &rows).await?;
        sqlx::query(
            "INSERT INTO partition_owner (partition_id, shard, epoch, state, changed_at) \
             VALUES ($1, $2, $3, 'incoming', now()) \
             ON CONFLICT (partition_id) DO UPDATE \
             SET shard = EXCLUDED.shard, epoch = EXCLUDED.epoch, state = 'incoming', \
                 changed_at = now()",
        )
        .bind(partition_id(partition)?)
        .bind(shard)
        .bind(new_epoch)
        .execute(&mut *txn)
        .await?;
        txn.commit().await?;
        Ok(rows.moved())
    }

    /// The old shard's rows of the partition, read in one snapshot with its owner row, which
    /// must be `fenced` at `epoch`: then no statement changes them any more.
    async fn read_fenced(&self, partition: u32, epoch: i64) -> Result<PartitionRows, RowsError> {
        let mut connection = self.pool.acquire().await?;
        let mut txn = connection.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *txn)
            .await?;
        no_statement_timeout(&mut txn).await?;
        expect_owner(&mut txn, partition, epoch, OwnerState::Fenced, "the copy").await?;
        let books = self.books(&mut txn, partition).await?;
        let stock: Vec<(Uuid, String, i32, i32)> = sqlx::query_as(
            "SELECT book_id, title, on_hand, reserved FROM stock_items \
             WHERE book_id = ANY($1) ORDER BY book_id",
        )
        .bind(&books)
        .fetch_all(&mut *txn)
        .await?;
        let reservations: Vec<Reservation> = sqlx::query_as(
            "SELECT order_id, book_id, quantity, status, message_id, created_at \
             FROM stock_reservations WHERE book_id = ANY($1)",
        )
        .bind(&books)
        .fetch_all(&mut *txn)
        .await?;
        let line_cancellations: Vec<(Uuid, Uuid, DateTime<FixedOffset>, String)> = sqlx::query_as(
            "SELECT order_id, book_id, cancelled_at, cancel_message_id \
                 FROM line_cancellations WHERE book_id = ANY($1)",
        )
        .bind(&books)
        .fetch_all(&mut *txn)
        .await?;
        let order_cancellations: Vec<(Uuid, DateTime<FixedOffset>, Option<String>)> =
            sqlx::query_as(
                "SELECT order_id, cancelled_at, cancel_message_id FROM order_states \
                 WHERE cancelled_at IS NOT NULL AND order_id IN \
                     (SELECT order_id FROM stock_reservations WHERE book_id = ANY($1))",
            )
            .bind(&books)
            .fetch_all(&mut *txn)
            .await?;
        txn.commit().await?;
        let rows = PartitionRows {
            stock,
            reservations,
            line_cancellations,
            order_cancellations,
        };
        let out_of_balance = rows.out_of_balance();
        if !out_of_balance.is_empty() {
            return Err(RowsError::OutOfBalance(out_of_balance));
        }
        Ok(rows)
    }

    /// The new shard's owner row `incoming` at `epoch` becomes `active`: it decides from now.
    pub async fn activate(&self, partition: u32, epoch: i64) -> Result<(), RowsError> {
        let active = OwnerRow {
            epoch,
            state: OwnerState::Active,
        };
        self.change_owner(ACTIVATE_SQL, partition, epoch, active, "activation")
            .await
    }

    /// The old shard's rows of the partition and its owner row deleted, if that row is
    /// `fenced` at `epoch`; gone already, nothing to do. Idle sessions that block it are ended
    /// as the fence ends them.
    pub async fn remove(
        &self,
        partition: u32,
        epoch: i64,
        idle_grace: Duration,
    ) -> Result<Moved, RowsError> {
        self.ending_idle_blockers("the removal", idle_grace, async |connection| {
            let mut txn = connection.begin().await?;
            no_statement_timeout(&mut txn).await?;
            let Some(row) = locked_owner_row(&mut txn, partition).await? else {
                return Ok(Moved::default());
            };
            if row
                != (OwnerRow {
                    epoch,
                    state: OwnerState::Fenced,
                })
            {
                return Err(refused("the removal", partition, row, epoch));
            }
            let removed = self.delete_partition(&mut txn, partition).await?;
            txn.commit().await?;
            Ok(removed)
        })
        .await
    }

    /// An abort's unfence on the old shard: its owner row at `epoch` (`fenced`, or still
    /// `active` when the abort came before the fence) becomes `active` at `new_epoch`.
    pub async fn unfence(
        &self,
        partition: u32,
        (epoch, new_epoch): (i64, i64),
    ) -> Result<(), RowsError> {
        let active = OwnerRow {
            epoch: new_epoch,
            state: OwnerState::Active,
        };
        self.change_owner(UNFENCE_SQL, partition, epoch, active, "the unfence")
            .await
    }

    /// [`change_owner`] in a transaction of its own.
    async fn change_owner(
        &self,
        sql: &'static str,
        partition: u32,
        epoch: i64,
        to: OwnerRow,
        action: &str,
    ) -> Result<(), RowsError> {
        let mut connection = self.pool.acquire().await?;
        let mut txn = connection.begin().await?;
        change_owner(&mut txn, sql, partition, epoch, to, action).await?;
        txn.commit().await?;
        Ok(())
    }

    /// An abort's drop of the copy on the new shard: the partition's rows and owner row
    /// deleted, unless it is `active` here. Idle sessions that block it are ended as the fence
    /// ends them.
    pub async fn drop_copy(
        &self,
        partition: u32,
        idle_grace: Duration,
    ) -> Result<Moved, RowsError> {
        self.ending_idle_blockers("the drop", idle_grace, async |connection| {
            let mut txn = connection.begin().await?;
            no_statement_timeout(&mut txn).await?;
            lock_unless_active(&mut txn, partition, "the drop").await?;
            let dropped = self.delete_partition(&mut txn, partition).await?;
            txn.commit().await?;
            Ok(dropped)
        })
        .await
    }

    /// The partition's rows and its owner row deleted: what the removal and the drop end with.
    async fn delete_partition(
        &self,
        txn: &mut Transaction<'_, Postgres>,
        partition: u32,
    ) -> Result<Moved, RowsError> {
        let books = self.books(txn, partition).await?;
        let deleted = delete_books(txn, &books).await?;
        sqlx::query("DELETE FROM partition_owner WHERE partition_id = $1")
            .bind(partition_id(partition)?)
            .execute(&mut **txn)
            .await?;
        Ok(deleted)
    }

    /// The partition's books among those this database holds rows of, in order.
    async fn books(
        &self,
        connection: &mut PgConnection,
        partition: u32,
    ) -> Result<Vec<Uuid>, RowsError> {
        let all: Vec<Uuid> = sqlx::query_scalar(BOOKS_SQL)
            .fetch_all(&mut *connection)
            .await?;
        let mut books: Vec<Uuid> = all
            .into_iter()
            .filter(|book| partition_of(BookId::from(*book), self.partitions) == partition)
            .collect();
        books.sort_unstable();
        Ok(books)
    }
}

/// One reservation, as `stock_reservations` holds it: order, book, quantity, status, message
/// id, when.
type Reservation = (Uuid, Uuid, i32, String, String, DateTime<FixedOffset>);

/// What a copy reads of a partition on the old shard.
struct PartitionRows {
    stock: Vec<(Uuid, String, i32, i32)>,
    reservations: Vec<Reservation>,
    line_cancellations: Vec<(Uuid, Uuid, DateTime<FixedOffset>, String)>,
    order_cancellations: Vec<(Uuid, DateTime<FixedOffset>, Option<String>)>,
}

impl PartitionRows {
    fn out_of_balance(&self) -> Vec<Uuid> {
        let stock: Vec<(Uuid, i64)> = self
            .stock
            .iter()
            .map(|(book, _, _, reserved)| (*book, i64::from(*reserved)))
            .collect();
        let held: Vec<(Uuid, i64)> = self
            .reservations
            .iter()
            .filter(|(_, _, _, status, _, _)| status == "reserved")
            .map(|(_, book, quantity, _, _, _)| (*book, i64::from(*quantity)))
            .collect();
        books_out_of_balance(&stock, &held)
    }

    fn moved(&self) -> Moved {
        Moved {
            books: self.stock.len(),
            reservations: self.reservations.len(),
            line_cancellations: self.line_cancellations.len(),
        }
    }
}

/// How many rows one INSERT carries: a partition's reservations go in slices of this many.
const INSERT_SLICE: usize = 10_000;

async fn insert(
    txn: &mut Transaction<'_, Postgres>,
    rows: &PartitionRows,
) -> Result<(), RowsError> {
    let stock = &rows.stock;
    sqlx::query(
        "INSERT INTO stock_items (book_id, title, on_hand, reserved) \
         SELECT * FROM unnest($1::uuid[], $2::text[], $3::int4[], $4::int4[])",
    )
    .bind(stock.iter().map(|s| s.0).collect::<Vec<_>>())
    .bind(stock.iter().map(|s| s.1.as_str()).collect::<Vec<_>>())
    .bind(stock.iter().map(|s| s.2).collect::<Vec<_>>())
    .bind(stock.iter().map(|s| s.3).collect::<Vec<_>>())
    .execute(&mut **txn)
    .await?;
    for slice in rows.reservations.chunks(INSERT_SLICE) {
        sqlx::query(
            "INSERT INTO stock_reservations \
                 (order_id, book_id, quantity, status, message_id, created_at) \
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int4[], $4::text[], $5::text[], \
                                  $6::timestamptz[])",
        )
        .bind(slice.iter().map(|r| r.0).collect::<Vec<_>>())
        .bind(slice.iter().map(|r| r.1).collect::<Vec<_>>())
        .bind(slice.iter().map(|r| r.2).collect::<Vec<_>>())
        .bind(slice.iter().map(|r| r.3.as_str()).collect::<Vec<_>>())
        .bind(slice.iter().map(|r| r.4.as_str()).collect::<Vec<_>>())
        .bind(slice.iter().map(|r| r.5).collect::<Vec<_>>())
        .execute(&mut **txn)
        .await?;
    }
    for slice in rows.line_cancellations.chunks(INSERT_SLICE) {
        sqlx::query(
            "INSERT INTO line_cancellations (order_id, book_id, cancelled_at, cancel_message_id) \
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::timestamptz[], $4::text[])",
        )
        .bind(slice.iter().map(|c| c.0).collect::<Vec<_>>())
        .bind(slice.iter().map(|c| c.1).collect::<Vec<_>>())
        .bind(slice.iter().map(|c| c.2).collect::<Vec<_>>())
        .bind(slice.iter().map(|c| c.3.as_str()).collect::<Vec<_>>())
        .execute(&mut **txn)
        .await?;
    }
    // An order's cancellation from before the stream was sharded, which the new shard may not
    // have: written unless the order is marked cancelled there already.
    for slice in rows.order_cancellations.chunks(INSERT_SLICE) {
        sqlx::query(
            "INSERT INTO order_states (order_id, cancelled_at, cancel_message_id) \
             SELECT * FROM unnest($1::uuid[], $2::timestamptz[], $3::text[]) \
             ON CONFLICT (order_id) DO UPDATE \
             SET cancelled_at = EXCLUDED.cancelled_at, \
                 cancel_message_id = EXCLUDED.cancel_message_id \
             WHERE order_states.cancelled_at IS NULL",
        )
        .bind(slice.iter().map(|c| c.0).collect::<Vec<_>>())
        .bind(slice.iter().map(|c| c.1).collect::<Vec<_>>())
        .bind(slice.iter().map(|c| c.2.as_deref()).collect::<Vec<_>>())
        .execute(&mut **txn)
        .await?;
    }
    Ok(())
}

/// The rows of `books` deleted: reservations, line cancellations, stock.
async fn delete_books(
    txn: &mut Transaction<'_, Postgres>,
    books: &[Uuid],
) -> Result<Moved, RowsError> {
    let count = |done: sqlx::postgres::PgQueryResult| {
        usize::try_from(done.rows_affected()).unwrap_or(usize::MAX)
    };
    let reservations = sqlx::query("DELETE FROM stock_reservations WHERE book_id = ANY($1)")
        .bind(books)
        .execute(&mut **txn)
        .await?;
    let line_cancellations = sqlx::query("DELETE FROM line_cancellations WHERE book_id = ANY($1)")
        .bind(books)
        .execute(&mut **txn)
        .await?;
    let stock = sqlx::query("DELETE FROM stock_items WHERE book_id = ANY($1)")
        .bind(books)
        .execute(&mut **txn)
        .await?;
    Ok(Moved {
        books: count(stock),
        reservations: count(reservations),
        line_cancellations: count(line_cancellations),
    })
}

/// A move's statements wait for locks and copy whole partitions: the connection's
/// statement_timeout, made for a message's work, does not bound them.
async fn no_statement_timeout(connection: &mut PgConnection) -> Result<(), RowsError> {
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *connection)
        .await?;
    Ok(())
}

async fn move_lock(connection: &mut PgConnection, partition: u32) -> Result<(), RowsError> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(MOVE_LOCK)
        .bind(i32::from(partition_id(partition)?))
        .execute(&mut *connection)
        .await?;
    Ok(())
}

async fn owner_row(
    connection: &mut PgConnection,
    partition: u32,
    sql: &'static str,
) -> Result<Option<OwnerRow>, RowsError> {
    let row: Option<(i64, String)> = sqlx::query_as(sql)
        .bind(partition_id(partition)?)
        .fetch_optional(&mut *connection)
        .await?;
    row.map(|(epoch, state)| {
        Ok(OwnerRow {
            epoch,
            state: owner_state(&state)?,
        })
    })
    .transpose()
}

/// On the new shard: the move's lock, and the owner row locked until commit, refused where the
/// partition is `active` (`what`, the copy or the drop, would undo the decisions made there).
async fn lock_unless_active(
    connection: &mut PgConnection,
    partition: u32,
    what: &str,
) -> Result<(), RowsError> {
    move_lock(connection, partition).await?;
    if let Some(row) = locked_owner_row(connection, partition).await?
        && row.state == OwnerState::Active
    {
        return Err(RowsError::Refused(format!(
            "{what}: partition {partition} is active on the new shard (epoch {})",
            row.epoch
        )));
    }
    Ok(())
}

async fn locked_owner_row(
    connection: &mut PgConnection,
    partition: u32,
) -> Result<Option<OwnerRow>, RowsError> {
    owner_row(connection, partition, LOCKED_OWNER_SQL).await
}

/// One of the owner row changes above (`sql`), from `epoch` to `to`: changed now, or already
/// `to` (a repeat of the action), else refused with what the row is.
async fn change_owner(
    connection: &mut PgConnection,
    sql: &'static str,
    partition: u32,
    epoch: i64,
    to: OwnerRow,
    action: &str,
) -> Result<(), RowsError> {
    let changed = sqlx::query(sql)
        .bind(partition_id(partition)?)
        .bind(epoch)
        .bind(to.epoch)
        .execute(&mut *connection)
        .await?;
    if changed.rows_affected() == 0 {
        expect_owner(connection, partition, to.epoch, to.state, action).await?;
    }
    Ok(())
}

/// The owner row must be `state` at `epoch` for `action` to go on.
async fn expect_owner(
    connection: &mut PgConnection,
    partition: u32,
    epoch: i64,
    state: OwnerState,
    action: &str,
) -> Result<(), RowsError> {
    match owner_row(connection, partition, OWNER_SQL).await? {
        Some(row) if row == OwnerRow { epoch, state } => Ok(()),
        Some(row) => Err(refused(action, partition, row, epoch)),
        None => Err(RowsError::Refused(format!(
            "{action}: partition {partition} has no owner row on this shard"
        ))),
    }
}

fn refused(action: &str, partition: u32, row: OwnerRow, epoch: i64) -> RowsError {
    RowsError::Refused(format!(
        "{action}: partition {partition}'s owner row is {} at epoch {}, not what the move \
         left at epoch {epoch}",
        state_name(row.state),
        row.epoch
    ))
}

fn owner_state(state: &str) -> Result<OwnerState, RowsError> {
    match state {
        "active" => Ok(OwnerState::Active),
        "fenced" => Ok(OwnerState::Fenced),
        "incoming" => Ok(OwnerState::Incoming),
        other => Err(RowsError::Refused(format!(
            "an owner row in a state this version does not know: {other:?}"
        ))),
    }
}

fn state_name(state: OwnerState) -> &'static str {
    match state {
        OwnerState::Active => "active",
        OwnerState::Fenced => "fenced",
        OwnerState::Incoming => "incoming",
    }
}

fn partition_id(partition: u32) -> Result<i16, RowsError> {
    i16::try_from(partition)
        .map_err(|_| RowsError::Refused(format!("partition {partition} is past i16::MAX")))
}
