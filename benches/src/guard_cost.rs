//! What the cancel guard costs: the placement statement (`RESERVE_SQL`) beside the statements
//! that bound it, each run by pgbench on the same books (`scripts/bench-cancel-guard.sh`), one
//! placement per statement. All take `RESERVE_SQL`'s parameters (arrays, of one here).
//!
//! Each bound drops one promise of the full statement, so the differences price them:
//! - `minimal`: the key alone, insert the reservation unless taken and move stock if it won
//!   (no availability check: it can reserve past the stock);
//! - `availability`: plus the stock row locked and the availability decided (reserved or
//!   rejected), which is the rule without the cancellation;
//! - `availability-event`: plus the decision's outbox event, written as `RESERVE_SQL` writes it;
//! - `reserve`: `RESERVE_SQL` itself, which adds the reservation looked up before any lock, the
//!   order's lock (`lock_order`) with the cancellation read after it, and what a batch needs
//!   (each key's first copy, each book's total wanted).

use inventory_infra::consumers::natural_pg::RESERVE_SQL;

/// The statements, by the name `inventory bench pgbench-script --statement` takes.
pub const STATEMENTS: [&str; 4] = ["minimal", "availability", "availability-event", "reserve"];

/// `RESERVE_SQL`'s text from `from` up to `to`, which must be there: the bounds take its
/// parameters and its event from it, so they bind and write the very same.
fn cut(from: &str, to: &str) -> &'static str {
    let start = RESERVE_SQL
        .find(from)
        .unwrap_or_else(|| panic!("RESERVE_SQL has {from:?}"));
    let end = RESERVE_SQL[start..]
        .find(to)
        .map(|end| start + end)
        .unwrap_or_else(|| panic!("RESERVE_SQL has {to:?} after {from:?}"));
    &RESERVE_SQL[start..end]
}

/// `RESERVE_SQL`'s parameters as rows (`input`), left open as its CTEs are.
fn input_cte() -> &'static str {
    cut("WITH input AS (", "), probed AS (")
}

/// `RESERVE_SQL`'s own event CTE, left open like the CTEs before it.
fn event_cte() -> &'static str {
    cut("), event AS (", "), outcome AS")
}

/// The key alone: the reservation unless its key is taken, stock moved where it won. Each bound
/// moves stock in `RESERVE_SQL`'s shape (the copies won per book, joined to the stock row), which
/// a lane's generic plan runs through the primary key.
const MINIMAL_CTES: &str = "\
), inserted AS (
    INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
    SELECT order_id, book_id, quantity, 'reserved', message_id, now() FROM input
    ON CONFLICT (order_id, book_id) DO NOTHING
    RETURNING book_id, quantity, status
), moved AS (
    UPDATE stock_items SET reserved = stock_items.reserved + won.copies
    FROM (SELECT book_id, sum(quantity) AS copies FROM inserted GROUP BY book_id) won
    WHERE stock_items.book_id = won.book_id
";

/// The availability rule's CTEs, named as in `RESERVE_SQL` so that its own `inserted` and
/// `moved`, cut out of it, read them; `RESERVE_SQL`'s lookup first, batch and order locks left
/// out.
const AVAILABILITY_CTES: &str = "\
), books AS (
    SELECT book_id, on_hand - reserved AS available FROM stock_items
    WHERE book_id IN (SELECT book_id FROM input)
    ORDER BY book_id
    FOR UPDATE
), decided AS (
    SELECT input.*, books.available,
           CASE WHEN books.available >= input.quantity THEN 'reserved' ELSE 'rejected' END
               AS status
    FROM input JOIN books USING (book_id)
";

/// `RESERVE_SQL`'s insert of the reservations and its move of stock where they won, left open
/// like the CTEs before them.
fn reservation_ctes() -> &'static str {
    cut("), inserted AS (", "), event AS (")
}

/// Closes the last CTE: each inserted placement's status, as `RESERVE_SQL` names it.
const RESULT: &str = ")\nSELECT status AS inserted_status FROM inserted";

/// The statement of `name` (one of [`STATEMENTS`]), with `RESERVE_SQL`'s parameters.
pub fn statement(name: &str) -> Option<String> {
    let input = input_cte();
    Some(match name {
        "minimal" => format!("{input}{MINIMAL_CTES}{RESULT}"),
        "availability" => format!("{input}{AVAILABILITY_CTES}{}{RESULT}", reservation_ctes()),
        "availability-event" => format!(
            "{input}{AVAILABILITY_CTES}{}{}{RESULT}",
            reservation_ctes(),
            event_cte()
        ),
        "reserve" => RESERVE_SQL.to_owned(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_has_its_brackets_closed_with_its_cuts_whole() {
        for name in STATEMENTS {
            let sql = statement(name).expect("every name of STATEMENTS has a statement");
            assert_eq!(sql.matches('(').count(), sql.matches(')').count(), "{name}");
        }
        assert!(input_cte().contains("unnest($1::uuid[]"));
        let reservation = reservation_ctes();
        assert!(
            reservation.starts_with("), inserted AS (") && reservation.contains("), moved AS (")
        );
        let event = event_cte();
        assert!(event.starts_with("), event AS (") && event.ends_with("ORDER BY decided.idx\n"));
        assert!(event.contains("INSERT INTO outbox"));
    }
}
