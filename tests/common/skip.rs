//! A test that cannot run its subject here says so.

/// Says on the test's real stderr why a test did not run its subject. `eprintln!` would be
/// captured by the test harness and shown only for failures, so a skipped GPU test would pass
/// silently; a write to the stderr handle is not captured.
pub fn skip(why: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{why}");
}
