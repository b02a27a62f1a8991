//! What the cancel guard costs: the placement statement (`RESERVE_SQL`) beside the statements
//! that bound it, each run by pgbench on the same books (`scripts/bench-cancel-guard.sh`).
//!
//! Each bound drops one promise of the full statement, so the differences price them:
//! - `minimal`: the key alone, insert the reservation unless taken and move stock if it won
//!   (no availability check: it can reserve past the stock);
//! - `availability`: plus the stock row locked and the availability decided (reserved or
//!   rejected), which is the rule without the cancellation;
//! - `availability-event`: plus the decision's outbox event, written as `RESERVE_SQL` writes it;
//! - `reserve`: `RESERVE_SQL` itself, which adds the reservation looked up before any lock and
//!   the order's lock (`lock_order`) with the cancellation read after it.

use inventory_infra::consumers::natural_pg::RESERVE_SQL;

/// The statements, by the name `inventory bench pgbench-script --statement` takes.
pub const STATEMENTS: [&str; 4] = ["minimal", "availability", "availability-event", "reserve"];

const MINIMAL_SQL: &str = "\
WITH inserted AS (
    INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
    VALUES ($1, $2, $3, 'reserved', $4, now())
    ON CONFLICT (order_id, book_id) DO NOTHING
    RETURNING status
), moved AS (
    UPDATE stock_items SET reserved = reserved + $3
    WHERE book_id = $2 AND EXISTS (SELECT 1 FROM inserted)
)
SELECT (SELECT status FROM inserted) AS inserted_status";

/// The availability rule's CTEs, named as in `RESERVE_SQL` so that its event CTE reads them;
/// the last one left open, as `RESERVE_SQL`'s CTEs are before `), event AS (`.
const AVAILABILITY_CTES: &str = "\
WITH stock AS (
    SELECT on_hand - reserved AS available FROM stock_items WHERE book_id = $2 FOR UPDATE
), decided AS (
    SELECT CASE WHEN available >= $3 THEN 'reserved' ELSE 'rejected' END AS status, available
    FROM stock
), inserted AS (
    INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
    SELECT $1, $2, $3, decided.status, $4, now() FROM decided
    ON CONFLICT (order_id, book_id) DO NOTHING
    RETURNING status
), moved AS (
    UPDATE stock_items SET reserved = reserved + $3
    WHERE book_id = $2 AND EXISTS (SELECT 1 FROM inserted WHERE status = 'reserved')
";

/// Closes the last CTE.
const AVAILABILITY_RESULT: &str = ")\nSELECT (SELECT status FROM inserted) AS inserted_status";

/// `RESERVE_SQL`'s own event CTE, cut out of it (left open, like the CTEs before it), so the
/// bound writes the very same row.
fn reserve_event_cte() -> &'static str {
    let start = RESERVE_SQL
        .find("), event AS (")
        .expect("RESERVE_SQL has an event CTE");
    let end = RESERVE_SQL[start..]
        .find("\n)\nSELECT")
        .map(|end| start + end + 1)
        .expect("RESERVE_SQL's event CTE ends before its SELECT");
    &RESERVE_SQL[start..end]
}

/// The statement of `name` (one of [`STATEMENTS`]), with `RESERVE_SQL`'s parameters.
pub fn statement(name: &str) -> Option<String> {
    Some(match name {
        "minimal" => MINIMAL_SQL.to_owned(),
        "availability" => format!("{AVAILABILITY_CTES}{AVAILABILITY_RESULT}"),
        "availability-event" => {
            format!(
                "{AVAILABILITY_CTES}{}{AVAILABILITY_RESULT}",
                reserve_event_cte()
            )
        }
        "reserve" => RESERVE_SQL.to_owned(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_has_its_brackets_closed_with_the_event_cut_whole() {
        for name in STATEMENTS {
            let sql = statement(name).expect("every name of STATEMENTS has a statement");
            assert_eq!(sql.matches('(').count(), sql.matches(')').count(), "{name}");
        }
        let event = reserve_event_cte();
        assert!(event.starts_with("), event AS (") && event.ends_with("'rejected')\n"));
        assert!(event.contains("INSERT INTO outbox"));
    }
}
