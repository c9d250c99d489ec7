//! The shared library exports exactly the functions the header declares: every defined dynamic
//! symbol is a `dpsync_*` function of include/dpsync.h, and every such function is exported.
//! Anything else (a Rust symbol, a dependency's C symbol) could clash with the program's own.
//! Reads the cdylib that cargo built beside this test with `nm -D --defined-only` (binutils).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The cdylib built with this test: target/<profile>/deps/libdpsync.so (the test runs from that
/// directory; `cargo test` builds the library's crate types there and copies them up to
/// target/<profile>/ only in `cargo build`).
fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let deps = exe
        .parent()
        .expect("the test runs from target/<profile>/deps");
    let lib = deps.join("libdpsync.so");
    assert!(
        lib.is_file(),
        "{} is missing: cargo builds it with the library (crate-type cdylib in Cargo.toml)",
        lib.display()
    );
    lib
}

/// The functions include/dpsync.h declares: `dpsync_x(` at the start of a declaration's name.
fn header_functions() -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/dpsync.h");
    let header = std::fs::read_to_string(&path).expect("include/dpsync.h");
    let mut names = BTreeSet::new();
    for line in header.lines().filter(|l| !l.trim_start().starts_with('*')) {
        let Some(open) = line.find('(') else { continue };
        let before = &line[..open];
        let name = before.rsplit([' ', '*']).next().unwrap_or("");
        if name.starts_with("dpsync_") {
            names.insert(name.to_owned());
        }
    }
    names
}

#[test]
fn only_the_headers_functions_are_exported() {
    let lib = cdylib();
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("nm (binutils) must be installed to check the exported symbols");
    assert!(
        out.status.success(),
        "nm -D {}: {}",
        lib.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let listing = String::from_utf8(out.stdout).expect("nm prints ASCII");
    let mut exported = BTreeSet::new();
    for line in listing.lines() {
        // "<address> <type> <name>"; a name may carry a version ("name@@VERS").
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, kind, name] = fields[..] else {
            panic!("unexpected nm line: {line}")
        };
        let name = name.split('@').next().unwrap_or(name);
        assert!(
            name.starts_with("dpsync_") && kind == "T",
            "{} exports {name} (nm type {kind}): only dpsync_* functions may be visible",
            lib.display()
        );
        exported.insert(name.to_owned());
    }
    let declared = header_functions();
    assert!(
        declared.len() > 30,
        "only {} functions found in include/dpsync.h: the parser here is out of step with it",
        declared.len()
    );
    let missing: Vec<_> = declared.difference(&exported).collect();
    let undeclared: Vec<_> = exported.difference(&declared).collect();
    assert!(
        missing.is_empty() && undeclared.is_empty(),
        "declared but not exported: {missing:?}; exported but not declared: {undeclared:?}"
    );
}
