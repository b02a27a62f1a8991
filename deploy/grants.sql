-- The grants of a role that runs `inventory serve`, `relay`, `stock`, `orders`, `outbox` and
-- `inbox purge` with --skip-migrations: it reads and writes rows and changes no schema. The
-- schema belongs to the role that runs `inventory migrate`. The same list is
-- migrations/src/lib.rs's `grants`, which those commands check at start.
--
--   psql "$OWNER_URL" -v role=inventory_service -f deploy/grants.sql
--
-- (the role must exist: CREATE ROLE inventory_service LOGIN PASSWORD '…';)

GRANT USAGE ON SCHEMA public TO :"role";
GRANT SELECT, INSERT, UPDATE, DELETE ON
    stock_items, stock_reservations, inbox, order_states, reservation_log,
    outbox, outbox_leases, outbox_relays, orders, order_lines, orders_outbox,
    partition_owner, line_cancellations
    TO :"role";
GRANT SELECT ON seaql_migrations TO :"role";
GRANT USAGE ON SEQUENCE outbox_seq_seq, orders_outbox_seq_seq TO :"role";
GRANT EXECUTE ON FUNCTION lock_order(uuid), owns_partition(smallint), lock_line(uuid, uuid)
    TO :"role";
