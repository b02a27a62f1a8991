//! Names the build in `inventory --version`: the commit it was built from (`VERGEN_GIT_SHA`,
//! absent where there is no git, as in a source archive) and the date (`VERGEN_BUILD_DATE`:
//! `SOURCE_DATE_EPOCH`'s when set, so that a reproducible build says the same every time).

use vergen_gitcl::{BuildBuilder, Emitter, GitclBuilder};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    Emitter::default()
        .add_instructions(&BuildBuilder::default().build_date(true).build()?)?
        .add_instructions(&GitclBuilder::default().sha(false).build()?)?
        .emit()?;
    Ok(())
}
