//! include/dpsync.h must be exactly what the pinned cbindgen generates from the sources.
//! `DPSYNC_BLESS=1 cargo test --release --test header` (or scripts/gen-header.sh) rewrites it.

use std::path::Path;

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
