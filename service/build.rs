//! Names the build in `inventory --version`: the git commit it was built from and the date,
//! `unknown` where there is no git (a source archive). `SOURCE_DATE_EPOCH`, when set, is the
//! date, so that a reproducible build says the same every time.

use std::process::Command;

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let date = match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(seconds) => date_of(&["-u", "-d", &format!("@{seconds}"), "+%Y-%m-%d"]),
        Err(_) => date_of(&["-u", "+%Y-%m-%d"]),
    };
    println!("cargo:rustc-env=INVENTORY_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=INVENTORY_BUILD_DATE={date}");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    // A checkout moves HEAD; a commit rewrites the index and the branch's ref.
    for path in ["../.git/HEAD", "../.git/index", "../.git/refs/heads"] {
        println!("cargo:rerun-if-changed={path}");
    }
}

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn date_of(args: &[&str]) -> String {
    Command::new("date")
        .args(args)
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map_or_else(
            || "unknown".into(),
            |output| String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        )
}
