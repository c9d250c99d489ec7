//! The describe JSON of host contexts: replicas, settings, buckets, registration problems.

use super::*;

// ------------------------------------------------------------------ describe (host)

fn grad_names_in_buckets(json: &Value) -> Vec<String> {
    buckets(json)
        .iter()
        .flat_map(|b| b.tensors.clone())
        .collect()
}

#[derive(Debug)]
struct Bucket {
    dtype: String,
    bytes: u64,
    elements: u64,
    tensors: Vec<String>,
}

fn buckets(json: &Value) -> Vec<Bucket> {
    json["buckets"]
        .as_array()
        .unwrap_or_else(|| panic!("describe has no \"buckets\" array: {json}"))
        .iter()
        .map(|b| Bucket {
            dtype: b["dtype"].as_str().expect("bucket dtype").to_owned(),
            bytes: b["bytes"].as_u64().expect("bucket bytes"),
            elements: b["elements"].as_u64().expect("bucket elements"),
            tensors: b["tensors"]
                .as_array()
                .expect("bucket tensors")
                .iter()
                .map(|t| t.as_str().expect("tensor name").to_owned())
                .collect(),
        })
        .collect()
}

/// Checks the bucket properties for GRADs registered in `order` (name, dtype, count).
fn check_buckets(json: &Value, order: &[(&str, DType, usize)], fusion: u64) -> Vec<Bucket> {
    let bs = buckets(json);
    let mut seen = Vec::new();
    for b in &bs {
        assert!(!b.tensors.is_empty(), "empty bucket {b:?}");
        let mut bytes = 0u64;
        let mut elems = 0u64;
        for t in &b.tensors {
            let (_, d, c) = order
                .iter()
                .find(|(n, _, _)| n == t)
                .unwrap_or_else(|| panic!("bucket lists '{t}', which is not a GRAD"));
            assert_eq!(d.name(), b.dtype, "'{t}' in a {} bucket", b.dtype);
            bytes += (c * d.size()) as u64;
            elems += *c as u64;
            seen.push(t.clone());
        }
        assert_eq!(b.bytes, bytes, "bucket bytes {b:?}");
        assert_eq!(b.elements, elems, "bucket elements {b:?}");
        assert!(
            b.bytes <= fusion || b.tensors.len() == 1,
            "bucket over fusion_bytes {fusion}: {b:?}"
        );
    }
    let mut sorted = seen.clone();
    sorted.sort();
    let mut want: Vec<String> = order.iter().map(|(n, _, _)| n.to_string()).collect();
    want.sort();
    assert_eq!(sorted, want, "every GRAD exactly once");
    // Per dtype, the buckets walk the tensors in reverse registration order.
    for d in DType::ALL {
        let got: Vec<String> = bs
            .iter()
            .filter(|b| b.dtype == d.name())
            .flat_map(|b| b.tensors.clone())
            .collect();
        let want: Vec<String> = order
            .iter()
            .rev()
            .filter(|(_, dt, _)| *dt == d)
            .map(|(n, _, _)| n.to_string())
            .collect();
        assert_eq!(
            got,
            want,
            "{} tensors in reverse registration order",
            d.name()
        );
    }
    // The first bucket starts with the last registered GRAD.
    if let Some(first) = bs.first() {
        assert_eq!(
            first.tensors[0],
            order.last().unwrap().0,
            "reduced last-registered first"
        );
    }
    bs
}

const MIXED: [(&str, DType, usize); 8] = [
    ("a_grad", DType::F32, 4),
    ("b_grad", DType::F32, 10),
    ("c_grad", DType::F64, 3),
    ("d_grad", DType::F32, 20),
    ("e_grad", DType::F16, 8),
    ("f_grad", DType::F32, 2),
    ("g_grad", DType::I32, 5),
    ("h_grad", DType::BF16, 3),
];

/// Registers MIXED as GRADs (plus a PARAM and a COMPUTED that must not appear in buckets).
fn register_mixed(ctx: &Context, n: usize) -> Vec<Vec<Buf>> {
    let mut keep = Vec::new();
    for r in 0..n {
        let mut p = Buf::zeros(DType::F32, 7);
        ctx.reg_buf("p", PARAM, r, &mut p);
        keep.push(vec![p]);
    }
    for (name, d, c) in MIXED {
        let mut per = Vec::new();
        for r in 0..n {
            let mut b = Buf::random(d, c, r as u64);
            ctx.reg_buf(name, GRAD, r, &mut b);
            per.push(b);
        }
        keep.push(per);
    }
    for r in 0..n {
        let mut q = Buf::zeros(DType::F64, 2);
        ctx.reg_buf("q", COMPUTED, r, &mut q);
        keep.push(vec![q]);
    }
    keep
}

#[test]
fn describe_lists_replicas_transport_and_settings() {
    let ctx = Context::host(1, None);
    let j = ctx.describe_json();
    assert_eq!(j["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(j["rank"], 0);
    assert_eq!(j["world_size"], 1);
    assert_eq!(j["transport"], "host");
    assert_eq!(j["fusion_bytes"], 26214400, "default fusion_bytes");
    assert_eq!(j["loss_scale"].as_f64(), Some(1.0));
    assert_eq!(j["replicas"].as_array().map(|a| a.len()), Some(1));

    let n = 5;
    let ctx = Context::host(n, Some(12345));
    let j = ctx.describe_json();
    let reps = j["replicas"].as_array().expect("replicas");
    assert_eq!(reps.len(), n);
    for (i, r) in reps.iter().enumerate() {
        assert_eq!(r["index"], i, "{r}");
        assert_eq!(r["device"], "host", "{r}");
    }
    assert_eq!(j["fusion_bytes"], 12345);
    assert_eq!(j["loss_scale"].as_f64(), Some(1.0 / n as f64));
    assert_eq!(j["transport"], "host");
    assert!(j["transport_reason"].is_string(), "{j}");
    let pa = j["peer_access"].as_array().expect("peer_access");
    assert_eq!(pa.len(), n);
    for row in pa {
        assert_eq!(row.as_array().map(|r| r.len()), Some(n));
        assert!(
            row.as_array().unwrap().iter().all(|v| *v == 0 || *v == 1),
            "{row}"
        );
    }
    assert_eq!(j["problems"], serde_json::json!([]), "no problems yet");
    assert_eq!(j["buckets"], serde_json::json!([]), "no GRADs yet");
}

#[test]
fn describe_buckets_reverse_order_per_dtype_within_fusion_bytes() {
    let n = 3;
    for fusion in [0u64, 16, 64, 100, GIB as u64] {
        let ctx = Context::host(n, Some(fusion as usize));
        let _keep = register_mixed(&ctx, n);
        let j = ctx.describe_json();
        assert_eq!(j["fusion_bytes"], fusion);
        let bs = check_buckets(&j, &MIXED, fusion);
        if fusion == 0 {
            assert_eq!(
                bs.len(),
                MIXED.len(),
                "fusion 0: every tensor its own bucket: {bs:?}"
            );
        }
        if fusion == 100 {
            // b_grad (40 B) and a_grad (16 B) are adjacent f32 tensors that fit together.
            assert!(bs.len() < MIXED.len(), "fusion 100 fuses something: {bs:?}");
        }
        // steps are present, over these replicas, on the host
        let steps = j["steps"]
            .as_array()
            .unwrap_or_else(|| panic!("no steps: {j}"));
        assert!(!steps.is_empty(), "steps for {n} replicas: {j}");
        for s in steps {
            assert!(s["op"].is_string(), "{s}");
            for k in ["src", "dst"] {
                if let Some(v) = s.get(k) {
                    assert!(v.as_u64().map(|v| v < n as u64) == Some(true), "{s}");
                }
            }
            if let Some(v) = s.get("via") {
                assert_eq!(v.as_str(), Some("host"), "{s}");
            }
        }
        let st = steps_of(&j);
        assert_plan_reduces(n, &st, &format!("host plan, fusion {fusion}"));
        // host: ((r0 + r1) + r2), summed into replica 0 in replica order
        let want: Vec<(usize, usize)> = (1..n).map(|r| (r, 0)).collect();
        assert_eq!(sums(&st), want, "host sums in replica order");
        // describe is a pure function of the registry
        let again = ctx.describe();
        assert_eq!(serde_json::from_str::<Value>(&again).unwrap(), j);
    }
}

#[test]
fn describe_one_dtype_fuses_into_one_bucket_when_it_fits() {
    let order: Vec<(&str, DType, usize)> = vec![
        ("w0", DType::F32, 10),
        ("w1", DType::F32, 1),
        ("w2", DType::F32, 100),
        ("w3", DType::F32, 7),
        ("w4", DType::F32, 33),
    ];
    let n = 2;
    for fusion in [0usize, 8, 43, 44, 603, 604, GIB] {
        let ctx = Context::host(n, Some(fusion));
        let mut keep = Vec::new();
        for (name, d, c) in &order {
            for r in 0..n {
                let mut b = Buf::zeros(*d, *c);
                ctx.reg_buf(name, GRAD, r, &mut b);
                keep.push(b);
            }
        }
        let bs = check_buckets(&ctx.describe_json(), &order, fusion as u64);
        match fusion {
            // w1 + w0 is 44 bytes: over 43
            0 | 8 | 43 => assert_eq!(bs.len(), 5, "{bs:?}"),
            603 => assert!(bs.len() >= 2, "604 bytes do not fit in 603: {bs:?}"),
            604 | GIB => {
                assert_eq!(bs.len(), 1, "all 604 bytes fit in one bucket: {bs:?}");
                assert_eq!(bs[0].tensors, vec!["w4", "w3", "w2", "w1", "w0"]);
                assert_eq!(bs[0].bytes, 604);
            }
            _ => assert!(bs.len() < 5, "{bs:?}"),
        }
    }
}

#[test]
fn grad_order_is_the_order_of_first_registration_on_any_replica() {
    let n = 2;
    let ctx = Context::host(n, Some(0));
    let mut bufs: Vec<Vec<f32>> = vec![vec![0.0; 3]; 8];
    let mut it = bufs.iter_mut();
    let mut next = || it.next().unwrap();
    // replica 1 registers first, in forward order; replica 0 later, in another order
    ctx.reg("x", GRAD, 1, next(), F32);
    ctx.reg("y", GRAD, 1, next(), F32);
    ctx.reg("z", GRAD, 1, next(), F32);
    ctx.reg("z", GRAD, 0, next(), F32);
    ctx.reg("x", GRAD, 0, next(), F32);
    ctx.reg("y", GRAD, 0, next(), F32);
    assert_eq!(
        grad_names_in_buckets(&ctx.describe_json()),
        vec!["z", "y", "x"]
    );
    // unregister and register again: the name is new, so it is now the last registered
    check(ctx.unregister("y"), "unregister");
    ctx.reg("y", GRAD, 0, next(), F32);
    ctx.reg("y", GRAD, 1, next(), F32);
    assert_eq!(
        grad_names_in_buckets(&ctx.describe_json()),
        vec!["y", "z", "x"]
    );
}

#[test]
fn describe_reports_registration_problems_and_unregister() {
    let n = 3;
    let ctx = Context::host(n, Some(64));
    let _keep = register_mixed(&ctx, n);
    let mut bad = vec![0f32; 4];
    ctx.reg("bad_grad", GRAD, 0, &mut bad, F32);
    let j = ctx.describe_json();
    let problems = j["problems"].as_array().expect("problems");
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap_or("").contains("'bad_grad'")),
        "problems should name 'bad_grad': {problems:?}"
    );
    check(ctx.unregister("bad_grad"), "unregister");
    check(ctx.unregister("c_grad"), "unregister");
    let j = ctx.describe_json();
    assert_eq!(j["problems"], serde_json::json!([]));
    let names = grad_names_in_buckets(&j);
    assert!(!names.contains(&"c_grad".to_owned()), "{names:?}");
    assert_eq!(names.len(), MIXED.len() - 1);
}

#[test]
fn describe_truncates_like_snprintf() {
    let ctx = Context::host(2, None);
    let full = ctx.describe();
    let total = full.len();
    assert!(total > 20);
    for cap in [1usize, 2, 10, total - 1, total, total + 1, total + 50] {
        let mut buf = vec![0xAAu8; cap + 8];
        let mut len = usize::MAX;
        let st = unsafe { dpsync::dpsync_describe(ctx.0, buf.as_mut_ptr().cast(), cap, &mut len) };
        check(st, "describe with a small buffer");
        assert_eq!(len, total, "*length is the full length (capacity {cap})");
        let written = (cap - 1).min(total);
        assert_eq!(
            &buf[..written],
            &full.as_bytes()[..written],
            "capacity {cap}"
        );
        assert_eq!(
            buf[written], 0,
            "NUL after {written} bytes (capacity {cap})"
        );
        assert!(
            buf[cap..].iter().all(|&b| b == 0xAA),
            "wrote past capacity {cap}"
        );
    }
    // the same rules for plan_describe
    let o = Options::host(2);
    let full = o.plan().expect("plan_describe");
    let mut buf = vec![0xAAu8; 9];
    let mut len = 0usize;
    let st = unsafe { dpsync::dpsync_plan_describe(o.0, buf.as_mut_ptr().cast(), 5, &mut len) };
    check(st, "plan_describe truncated");
    assert_eq!(len, full.len());
    assert_eq!(&buf[..4], &full.as_bytes()[..4]);
    assert_eq!(buf[4], 0);
    assert!(buf[5..].iter().all(|&b| b == 0xAA));
}

#[test]
fn plan_describe_for_host_options_matches_describe_of_a_context() {
    let o = Options::host(4);
    o.set_fusion_bytes(4096);
    let j = o.plan_json();
    assert_eq!(j["transport"], "host");
    assert_eq!(j["fusion_bytes"], 4096);
    assert_eq!(j["replicas"].as_array().map(|a| a.len()), Some(4));
    for (i, r) in j["replicas"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["device"], "host");
        assert_eq!(r["index"], i);
    }
    let ctx = Context::new(&o);
    let d = ctx.describe_json();
    assert_eq!(d["replicas"], j["replicas"]);
    assert_eq!(d["transport"], j["transport"]);
    assert_eq!(d["steps"], j["steps"]);
}
