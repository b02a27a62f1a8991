//! Where a book's stock lives once stock is sharded by book. Each order line travels on a subject
//! that names its book (`orders.placed.<book_id>`); the stream maps that subject onto one of P
//! fixed partitions with nats-server's `partition(P, …)` function, and each partition belongs to
//! one shard. [`partition_of`] is the server's function computed here, so that a command can say
//! where a book lives and a consumer can check that a message's book belongs to its partition; a
//! test (`tests/integration/routing.rs`) holds it equal to the server's mapping for 100,000 books.

use std::num::NonZeroU32;

use crate::BookId;

/// The partitions of a sharded stream unless it was made with another count. Never changed in
/// place: every book's partition would change with it.
pub const DEFAULT_PARTITIONS: NonZeroU32 = NonZeroU32::new(64).unwrap();

/// The partition of `book` among `partitions`, as nats-server's `partition(P, n)` computes it from
/// the subject token that names the book: FNV-1a (32 bits) over the token's bytes, modulo P.
///
/// The token is the id in its canonical form, lowercase and hyphenated ([`BookId`]'s `Display`):
/// the server hashes the bytes it is given, so an uppercase spelling of the same id can land
/// elsewhere (with P a power of two, whenever the id has an odd number of the letters a to f).
/// Producers put the book in the subject in this form.
pub fn partition_of(book: BookId, partitions: NonZeroU32) -> u32 {
    fnv1a(book.to_string().as_bytes()) % partitions
}

/// FNV-1a, 32 bits: Go's `hash/fnv` `New32a`, which the server's partition function uses.
fn fnv1a(bytes: &[u8]) -> u32 {
    const OFFSET_BASIS: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    bytes.iter().fold(OFFSET_BASIS, |hash, byte| {
        (hash ^ u32::from(*byte)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_gives_the_published_test_vectors() {
        // From the FNV reference's test suite (Fowler, Noll, Vo).
        assert_eq!(fnv1a(b""), 0x811c_9dc5);
        assert_eq!(fnv1a(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn a_book_is_hashed_as_its_lowercase_subject_token() {
        // Fifteen letters: odd, so the two spellings fall in different partitions of 64 (a case
        // flip changes only bit 5 of each byte, which the low six bits of the hash see once per
        // flip).
        let spelled = "0B5E2C1A-9F3D-4C7E-8A61-2D4F6B8C0E1A";
        let book = BookId::parse(spelled).expect("a UUID");
        let token = "0b5e2c1a-9f3d-4c7e-8a61-2d4f6b8c0e1a";
        assert_eq!(book.to_string(), token);
        assert_ne!(fnv1a(spelled.as_bytes()) % 64, fnv1a(token.as_bytes()) % 64);
        assert_eq!(
            partition_of(book, DEFAULT_PARTITIONS),
            fnv1a(token.as_bytes()) % 64
        );
    }
}
