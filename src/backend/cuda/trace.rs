//! The timeline's device spans on CUDA replicas: when `DPSYNC_TIMELINE` is on, every collective
//! records a timed event on each group's stream where its work starts (after the callers'
//! work) and one where it ends; once the collective is seen complete, each pair becomes a span
//! on that GPU's row, placed by the time from a reference event recorded when tracing began
//! (the host's clock at that moment).

use serde_json::json;

use super::driver::Event;
use super::CudaBackend;
use crate::error::Result;
use crate::timeline::Tracer;

/// A context's device tracing: the tracer, and per group its row and reference event.
pub(super) struct DeviceTrace {
    tracer: Tracer,
    /// Per group: (row, reference event, the host's µs when it completed).
    groups: Vec<(usize, Event, f64)>,
    /// Collectives traced so far (the spans' `collective` argument).
    count: usize,
}

/// One collective's start and end events, per group.
pub(super) struct Timing {
    starts: Vec<Event>,
    stops: Vec<Event>,
}

impl CudaBackend {
    /// Starts device spans: a reference event per group, recorded on an idle stream and waited
    /// for, so that its host time is known.
    pub(super) fn start_tracing(&mut self, tracer: Tracer) -> Result<()> {
        let mut groups = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let _bound = g.ctx.bind()?;
            let reference = Event::timed()?;
            reference.record(g.stream.0)?;
            // Everything queued so far has run, the reference too: its host time is now.
            self.wait_group(g)?;
            let host = tracer.now_us();
            let row = tracer.row(&format!("cuda:{} (device time)", g.ctx.ordinal));
            groups.push((row, reference, host));
        }
        *self.trace.get_mut() = Some(DeviceTrace {
            tracer,
            groups,
            count: 0,
        });
        Ok(())
    }

    /// Records each group's start event (inside `begin`, after the waits on the callers).
    pub(super) fn timing_starts(&self) -> Result<Option<Vec<Event>>> {
        if self.trace.lock().is_none() {
            return Ok(None);
        }
        let mut starts = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let _bound = g.ctx.bind()?;
            let e = Event::timed()?;
            e.record(g.stream.0)?;
            starts.push(e);
        }
        Ok(Some(starts))
    }

    /// Records each group's end event (inside `end`).
    pub(super) fn timing_stops(&self, starts: Vec<Event>) -> Result<Timing> {
        let mut stops = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let _bound = g.ctx.bind()?;
            let e = Event::timed()?;
            e.record(g.stream.0)?;
            stops.push(e);
        }
        Ok(Timing { starts, stops })
    }

    /// A completed collective's spans onto the timeline (a failed reading drops them).
    pub(super) fn emit(&self, timing: Timing) {
        let mut trace = self.trace.lock();
        let Some(trace) = trace.as_mut() else { return };
        trace.count += 1;
        for (g, (start, stop)) in timing.starts.iter().zip(&timing.stops).enumerate() {
            let (row, reference, host) = &trace.groups[g];
            let _bound = self.groups[g].ctx.bind();
            let (Ok(from_ref), Ok(dur)) = (reference.elapsed_ms(start), start.elapsed_ms(stop))
            else {
                continue;
            };
            trace.tracer.complete(
                *row,
                "collective on device",
                host + f64::from(from_ref) * 1e3,
                f64::from(dur) * 1e3,
                json!({"collective": trace.count}),
            );
        }
    }
}
