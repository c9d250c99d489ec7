//! `dpsync_options_*`: building the options a context is created from.

use super::boundary::{entry, try_enum, try_mut};
use super::status::dpsync_status;
use crate::error::{Error, Result};
use crate::options::{check_replica_count, Options};
use crate::types::Transport;

/// The object behind a `dpsync_options *`.
pub struct dpsync_options {
    pub(super) inner: Options,
}

/// Runs `body` on the options behind `options`, under the boundary.
fn with_options(
    options: *mut dpsync_options,
    body: impl FnOnce(&mut Options) -> Result<()>,
) -> dpsync_status {
    // SAFETY: a non-NULL pointer comes from dpsync_options_new (the C contract).
    entry(|| body(&mut unsafe { try_mut(options, "options") }?.inner))
}

/// Creates options with the defaults: 1 host replica, transport AUTO, fusion buckets of 25 MiB,
/// no timeout, peer access detected. Free with dpsync_options_free.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_new(out: *mut *mut dpsync_options) -> dpsync_status {
    entry(|| {
        let out = try_mut(out, "out")?;
        *out = Box::into_raw(Box::new(dpsync_options {
            inner: Options::default(),
        }));
        Ok(())
    })
}

/// Frees options made by dpsync_options_new. NULL is accepted.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_free(options: *mut dpsync_options) {
    if !options.is_null() {
        // SAFETY: the pointer came from Box::into_raw in dpsync_options_new.
        drop(Box::from_raw(options));
    }
}

/// `count` replicas whose tensors live in host memory. This is the default (1 replica).
/// count must be 1..=4096.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_host_replicas(
    options: *mut dpsync_options,
    count: usize,
) -> dpsync_status {
    with_options(options, |o| o.set_host_replicas(count))
}

/// One replica per entry; entries are CUDA device ordinals and may repeat (replicas sharing a
/// GPU are reduced on that GPU first, then one communicator rank per distinct GPU).
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_cuda_replicas(
    options: *mut dpsync_options,
    ordinals: *const i32,
    count: usize,
) -> dpsync_status {
    with_options(options, |o| {
        if ordinals.is_null() {
            return Err(Error::invalid("ordinals is NULL"));
        }
        check_replica_count(count, "count")?;
        // SAFETY: the caller passes `count` readable ordinals.
        o.set_cuda_replicas(std::slice::from_raw_parts(ordinals, count))
    })
}

/// Transport (a DPSYNC_TRANSPORT_* value). A transport that does not fit the replicas (HOST
/// with CUDA replicas, NCCL or PEER_COPY with host replicas) is refused when the context or
/// plan is made.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_transport(
    options: *mut dpsync_options,
    transport: u32,
) -> dpsync_status {
    with_options(options, |o| {
        o.transport = try_enum(
            transport,
            Transport::from_code,
            "transport",
            "DPSYNC_TRANSPORT_AUTO/NCCL/PEER_COPY/HOST (0..3)",
        )?;
        Ok(())
    })
}

/// Fusion bucket capacity in bytes for dpsync_allreduce_grads; 0 disables fusion.
/// Default 25 MiB (see docs/API.md for why).
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_fusion_bytes(
    options: *mut dpsync_options,
    bytes: usize,
) -> dpsync_status {
    with_options(options, |o| {
        o.fusion_bytes = bytes;
        Ok(())
    })
}

/// Timeout for one collective; 0 means wait forever.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_timeout_ms(
    options: *mut dpsync_options,
    timeout_ms: u64,
) -> dpsync_status {
    with_options(options, |o| {
        o.set_timeout_ms(timeout_ms);
        Ok(())
    })
}

/// Override the detected peer-access matrix of the replicas' devices: `n` x `n`, row-major,
/// matrix[i*n+j] != 0 means replica i's device can read replica j's device memory directly.
/// n must equal the replica count (set the replicas first). Used to force a topology (e.g. for
/// tests or a known-bad link). Replicas on the same device always have access.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_peer_access(
    options: *mut dpsync_options,
    matrix: *const u8,
    n: usize,
) -> dpsync_status {
    with_options(options, |o| {
        if matrix.is_null() {
            return Err(Error::invalid("matrix is NULL"));
        }
        o.check_peer_size(n)?;
        // SAFETY: the caller passes n * n readable bytes.
        o.set_peer_access(std::slice::from_raw_parts(matrix, n * n), n)
    })
}

/// Reproducible reductions (default false). When true, every floating-point SUM or AVG dpsync
/// computes (allreduce_grads, reduce_scatter_grads, allreduce, average, bmuf_step's mean and the
/// sums of coalesced sparse rows) is a function of the multiset of the W contributions alone:
/// the same bytes whatever the arrangement of replicas over ranks, hosts and devices, the fusion
/// size, threads, transport or arrival order. F32/F16/BF16 results are within one ulp of the
/// exact sum unless the element cancels below 2^-12 of its largest contribution; F64 within
/// 2^-36 of that largest contribution (worlds up to 4096 replicas). Integer dtypes are exact
/// either way. In a world every rank must set the same value (otherwise dpsync_context_create
/// is INCONSISTENT naming the option and the ranks). Costs: docs/PERFORMANCE.md.
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_reproducible(
    options: *mut dpsync_options,
    enabled: bool,
) -> dpsync_status {
    with_options(options, |o| {
        o.reproducible = enabled;
        Ok(())
    })
}

/// Sparse gradients: coalesce duplicate indices (each replica's slice before the gather and the
/// gathered result after), so gathered slices hold unique, sorted indices with summed rows
/// (f16/bf16 summed in f32). Default false: the gathered slice is the plain concatenation in
/// world order. Either way, scatter-adding the gathered slice gives the same model up to
/// rounding; coalescing moves fewer bytes when indices repeat (skewed, Zipf-like streams).
#[no_mangle]
pub unsafe extern "C" fn dpsync_options_set_sparse_coalesce(
    options: *mut dpsync_options,
    coalesce: bool,
) -> dpsync_status {
    with_options(options, |o| {
        o.sparse_coalesce = coalesce;
        Ok(())
    })
}
