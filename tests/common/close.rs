//! f32 results compared within a tolerance (trained models, where the order of float sums
//! differs between runs).

/// Bytes of an f32 slice.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Element-wise |a - b| <= atol + rtol * |b|.
#[track_caller]
pub fn assert_allclose(a: &[f32], b: &[f32], rtol: f32, atol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * y.abs(),
            "{what}: element {i}: {x} vs {y} (rtol {rtol}, atol {atol})"
        );
    }
}
