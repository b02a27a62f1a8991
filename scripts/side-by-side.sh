# Sourced by the scripts that run the service's loop (`inventory bench end-to-end`) and the
# hand-written sqlx loop (`inventory bench hand-written --driver sqlx`) on the same workload.
# Expects `messages` (orders a run) set; sets `inventory` (the study binary: INVENTORY_BIN, or
# the release build, built here), `books`, `url` and `lanes` per backend, and `run`.

postgres=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export NATS_URL=${NATS_URL:-nats://127.0.0.1:4222}

inventory=${INVENTORY_BIN:-}
if [ -z "$inventory" ]; then
  cargo build --release --locked -p inventory-benches --bins >&2
  inventory=${CARGO_TARGET_DIR:-target}/release/inventory-study
fi

books=1000
declare -A url=([postgres]=$postgres [sqlite]=sqlite://)
# serve's default lanes on each backend, for the batches.
declare -A lanes=([postgres]=10 [sqlite]=2)

# One run's JSON report; a command prefix (perf record …) runs the binary under it.
run() { # run <service|loop> <backend> <lanes> <batch> [command prefix…]
  local consumer=$1 backend=$2 n=$3 batch=$4
  shift 4
  local command=(bench end-to-end)
  [ "$consumer" = loop ] && command=(bench hand-written --driver sqlx)
  "$@" "$inventory" "${command[@]}" --json --database-url "${url[$backend]}" \
    --messages "$messages" --books "$books" --concurrency "$n" --batch-size "$batch"
}
