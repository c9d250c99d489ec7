//! include/dpsync.h must be exactly what the pinned cbindgen generates from the sources.
//! `DPSYNC_BLESS=1 cargo test --release --test header` (or scripts/gen-header.sh) rewrites it.
//! Its version macros must be Cargo.toml's version, which `dpsync_version()` returns.

use std::ffi::CStr;
use std::path::Path;

use dpsync::{dpsync_version, DPSYNC_VERSION_MAJOR, DPSYNC_VERSION_MINOR, DPSYNC_VERSION_PATCH};

#[test]
fn committed_header_is_up_to_date() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(root)
        .with_config(config)
        .generate()
        .expect("cbindgen could not parse the crate")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    let path = root.join("include/dpsync.h");
    if std::env::var_os("DPSYNC_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/dpsync.h");
        return;
    }
    // Only the library's own names may reach C users' namespace.
    for line in generated.lines() {
        if let Some(rest) = line.strip_prefix("#define ") {
            let name = rest.split_whitespace().next().unwrap_or("");
            assert!(
                name.starts_with("DPSYNC_"),
                "the header leaks the macro {name}: make the Rust constant pub(crate)"
            );
        }
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/dpsync.h is stale: run scripts/gen-header.sh and commit the result"
    );
}

#[test]
fn version_macros_are_cargo_tomls_version() {
    let cargo = |part: &str| part.parse::<u32>().expect("a numeric version part");
    assert_eq!(
        [
            DPSYNC_VERSION_MAJOR,
            DPSYNC_VERSION_MINOR,
            DPSYNC_VERSION_PATCH
        ],
        [
            cargo(env!("CARGO_PKG_VERSION_MAJOR")),
            cargo(env!("CARGO_PKG_VERSION_MINOR")),
            cargo(env!("CARGO_PKG_VERSION_PATCH")),
        ],
        "DPSYNC_VERSION_* in src/ffi/status.rs differ from Cargo.toml's version: update them and \
         run scripts/gen-header.sh"
    );
    // SAFETY: a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr(dpsync_version()) }
        .to_str()
        .unwrap();
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    let macros = format!("{DPSYNC_VERSION_MAJOR}.{DPSYNC_VERSION_MINOR}.{DPSYNC_VERSION_PATCH}");
    // Cargo.toml's version may carry a pre-release or build suffix ("0.2.0-rc.1").
    let rest = version.strip_prefix(&macros);
    assert!(
        matches!(rest, Some(r) if r.is_empty() || r.starts_with(['-', '+'])),
        "dpsync_version() is {version}, the macros say {macros}"
    );
}
