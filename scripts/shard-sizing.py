#!/usr/bin/env python3
"""How many orders a second K shards take, by a small model (docs/scaling.md, "Sizing").

Books: N of them with random UUIDs (seeded), popularity Zipf(s): the book of rank i gets the
share i^-s / sum_j j^-s of the orders. Each book's partition is nats-server's, as
inventory_domain::shard::partition_of computes it: FNV-1a (32 bits) over the lowercase UUID
string, modulo P. Shard j of K owns the contiguous partitions [j*P/K, (j+1)*P/K), as
`inventory shard assign --partitions A-B` gives them. Orders arrive in those proportions at a
total rate T, and T is the largest rate for which
  - no shard gets more than one shard's rate (--shard-rate): the busiest shard saturates first,
    T <= shard_rate / (share of the busiest shard);
  - no book gets more than its stock row takes (--hot-row): every placement of a book locks
    that one row, on one shard, so T <= hot_row / (share of the top book), whatever K;
  - the stream stores no more than --stream a second: every order passes one stream's leader.
Each shard is assumed a machine of its own (its rate does not fall as K grows), a shard's rate
the same whatever mix of books it serves, and the three ceilings independent of each other.

  scripts/shard-sizing.py --shard-rate R --hot-row H --stream S [--books 10000]
      [--partitions 64] [--zipf 0.8,1.0,1.2] [--shards 1,2,4,8,16,32,64] [--seed 1]
      [--markdown]
"""

import argparse
import random
import uuid


def fnv1a(data: bytes) -> int:
    """FNV-1a, 32 bits: Go's hash/fnv New32a, the server's partition function's hash."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def partition_of(book: str, partitions: int) -> int:
    return fnv1a(book.encode()) % partitions


def zipf_shares(n: int, s: float) -> list[float]:
    weights = [i ** -s for i in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def books(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n)]


def model(args, s: float, ids: list[str]) -> list[dict]:
    shares = zipf_shares(len(ids), s)
    load = [0.0] * args.partitions
    for book, share in zip(ids, shares):
        load[partition_of(book, args.partitions)] += share
    top = shares[0]
    rows = []
    for k in args.shards:
        if args.partitions % k:
            raise SystemExit(f"K = {k} does not divide P = {args.partitions}")
        per = args.partitions // k
        shard_loads = [sum(load[j * per:(j + 1) * per]) for j in range(k)]
        busiest = max(shard_loads)
        bounds = {
            "busiest shard": args.shard_rate / busiest,
            "hot row": args.hot_row / top,
            "stream": args.stream,
        }
        binding = min(bounds, key=bounds.get)
        rows.append({
            "k": k,
            "busiest": busiest,
            "imbalance": busiest * k,
            "shard_bound": bounds["busiest shard"],
            "hot_bound": bounds["hot row"],
            "stream_bound": bounds["stream"],
            "rate": bounds[binding],
            "binding": binding,
            "top": top,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shard-rate", type=float, required=True,
                        help="orders/s one shard sustains")
    parser.add_argument("--hot-row", type=float, required=True,
                        help="orders/s one book's stock row sustains")
    parser.add_argument("--stream", type=float, required=True,
                        help="orders/s one stream stores (with the subject transform)")
    parser.add_argument("--books", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--zipf", default="0.8,1.0,1.2",
                        help="Zipf exponents s, comma separated")
    parser.add_argument("--shards", default="1,2,4,8,16,32,64",
                        help="shard counts K, comma separated; each must divide P")
    parser.add_argument("--seed", type=int, default=1, help="seed of the books' UUIDs")
    parser.add_argument("--markdown", action="store_true", help="one Markdown table")
    args = parser.parse_args()
    args.shards = [int(k) for k in args.shards.split(",")]
    exponents = [float(s) for s in args.zipf.split(",")]
    ids = books(args.books, args.seed)

    print(f"{args.books} books (seed {args.seed}), P = {args.partitions}; one shard "
          f"{args.shard_rate:,.0f} orders/s, one book's row {args.hot_row:,.0f}, the stream "
          f"{args.stream:,.0f}")
    if args.markdown:
        print()
        print("| s | K | top book's share | busiest shard's share | busiest ÷ mean | "
              "shard bound | hot-row bound | orders/s | bound by |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for s in exponents:
        rows = model(args, s, ids)
        if not args.markdown:
            print(f"\nZipf s = {s}: the top book takes {rows[0]['top']:.1%} of the orders")
            print(f"{'K':>3} {'busiest shard':>13} {'÷ mean':>7} {'shard bound':>12} "
                  f"{'hot-row bound':>13} {'orders/s':>10}  bound by")
        previous = None
        for row in rows:
            bend = ""
            if previous is not None and row["binding"] != previous:
                bend = " <- bends"
            previous = row["binding"]
            if args.markdown:
                print(f"| {s} | {row['k']} | {row['top']:.1%} | {row['busiest']:.1%} | "
                      f"{row['imbalance']:.2f} | {row['shard_bound']:,.0f} | "
                      f"{row['hot_bound']:,.0f} | {row['rate']:,.0f} | "
                      f"{row['binding']}{bend} |")
            else:
                print(f"{row['k']:>3} {row['busiest']:>13.1%} {row['imbalance']:>7.2f} "
                      f"{row['shard_bound']:>12,.0f} {row['hot_bound']:>13,.0f} "
                      f"{row['rate']:>10,.0f}  {row['binding']}{bend}")


if __name__ == "__main__":
    main()
