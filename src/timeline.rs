//! The timeline: `DPSYNC_TIMELINE=/path/trace.json` writes a Chrome trace-event file (Perfetto,
//! chrome://tracing) of what every context does: per collective its call, the agreement
//! between ranks, each bucket (its tensors and bytes) and, in a world, the local sum, the
//! transfer across ranks and the spread back; `dpsync_grad_ready` marks as instants. `%r` in
//! the path becomes the rank of the first context created in a world, so that each rank writes
//! its own file.
//!
//! One file per process, opened by the first context created while the variable is set.
//! Events are kept in a bounded buffer and appended when it fills, when a context is destroyed
//! and at process exit; after each append the file is a complete JSON array (the closing
//! bracket is rewritten). Unset, every trace point is one branch on a `None`.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Instant;

use parking_lot::Mutex;
use serde_json::{json, Value};

/// Events buffered before they are appended to the file.
const BUFFERED: usize = 4096;

struct Writer {
    file: File,
    /// Where the closing `\n]\n` starts: the next events overwrite it.
    end: u64,
    /// Whether the array has an event yet (commas go between events).
    any: bool,
    pending: Vec<Value>,
    /// An I/O error stops the timeline, never the collectives.
    failed: bool,
}

pub struct Timeline {
    writer: Mutex<Writer>,
    start: Instant,
    pid: usize,
}

static PROCESS: Mutex<Option<Arc<Timeline>>> = Mutex::new(None);
static NEXT_TID: AtomicUsize = AtomicUsize::new(1);
static AT_EXIT: Once = Once::new();

extern "C" {
    /// The C library's (cbindgen.toml excludes it from the header).
    fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
}

extern "C" fn flush_at_exit() {
    if let Some(t) = PROCESS.lock().as_ref() {
        t.flush();
    }
}

impl Timeline {
    /// The process's timeline when `DPSYNC_TIMELINE` names a file (opened by the first call;
    /// `rank` replaces `%r`), else `None`. A file that cannot be created is reported on
    /// stderr once (the variable asked for it) and the context goes on without a timeline.
    fn of_process(rank: usize) -> Option<Arc<Timeline>> {
        let path = std::env::var_os("DPSYNC_TIMELINE")?;
        let mut process = PROCESS.lock();
        if let Some(t) = process.as_ref() {
            return Some(t.clone());
        }
        let path = path.to_string_lossy().replace("%r", &rank.to_string());
        let mut file = match File::create(&path) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("dpsync: DPSYNC_TIMELINE: cannot create {path}: {e}");
                return None;
            }
        };
        let _ = file.write_all(b"[\n\n]\n");
        let timeline = Arc::new(Timeline {
            writer: Mutex::new(Writer {
                file,
                end: 2,
                any: false,
                pending: Vec::new(),
                failed: false,
            }),
            start: Instant::now(),
            pid: rank,
        });
        *process = Some(timeline.clone());
        // SAFETY: registering a plain function.
        AT_EXIT.call_once(|| unsafe {
            atexit(flush_at_exit);
        });
        Some(timeline)
    }

    fn now_us(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1e6
    }

    fn push(&self, event: Value) {
        let mut w = self.writer.lock();
        w.pending.push(event);
        if w.pending.len() >= BUFFERED {
            w.append();
        }
    }

    /// Appends the buffered events; the file is a complete JSON array afterwards.
    pub fn flush(&self) {
        self.writer.lock().append();
    }
}

impl Writer {
    fn append(&mut self) {
        if self.pending.is_empty() || self.failed {
            self.pending.clear();
            return;
        }
        let mut text = String::new();
        for event in self.pending.drain(..) {
            if self.any {
                text.push_str(",\n");
            }
            self.any = true;
            text.push_str(&event.to_string());
        }
        let written = (|| -> std::io::Result<()> {
            self.file.seek(SeekFrom::Start(self.end))?;
            self.file.write_all(text.as_bytes())?;
            self.end += text.len() as u64;
            self.file.write_all(b"\n]\n")?;
            self.file.flush()
        })();
        if let Err(e) = written {
            eprintln!("dpsync: DPSYNC_TIMELINE: writing failed ({e}); the timeline stops here");
            self.failed = true;
        }
    }
}

/// One context's view of the timeline: its thread id in the trace.
#[derive(Clone)]
pub struct Tracer {
    timeline: Arc<Timeline>,
    tid: usize,
}

impl Tracer {
    /// A tracer for a new context when the timeline is on: names the process (`rank`,
    /// `process`) and the context's row (`label`).
    pub fn for_context(rank: usize, process: &str, label: &str) -> Option<Tracer> {
        let timeline = Timeline::of_process(rank)?;
        let tid = NEXT_TID.fetch_add(1, Ordering::Relaxed);
        let pid = timeline.pid;
        timeline.push(
            json!({"ph": "M", "name": "process_name", "pid": pid, "tid": tid,
                             "args": {"name": process}}),
        );
        timeline.push(
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                             "args": {"name": format!("context {tid}: {label}")}}),
        );
        Some(Tracer { timeline, tid })
    }

    /// A span from now until the returned guard drops, with `args` (made now).
    pub fn span(&self, name: &str, args: Value) -> Span {
        Span {
            tracer: self.clone(),
            name: name.to_owned(),
            start: self.timeline.now_us(),
            args,
        }
    }

    /// A mark at this moment.
    pub fn instant(&self, name: &str, args: Value) {
        let t = &self.timeline;
        t.push(
            json!({"ph": "i", "s": "t", "name": name, "pid": t.pid, "tid": self.tid,
                      "ts": t.now_us(), "args": args}),
        );
    }

    pub fn flush(&self) {
        self.timeline.flush();
    }

    /// Microseconds since the timeline began: where device spans are placed from.
    pub fn now_us(&self) -> f64 {
        self.timeline.now_us()
    }

    /// A new row of this process named `name` (a device's spans); its id.
    pub fn row(&self, name: &str) -> usize {
        let tid = NEXT_TID.fetch_add(1, Ordering::Relaxed);
        let t = &self.timeline;
        t.push(
            json!({"ph": "M", "name": "thread_name", "pid": t.pid, "tid": tid,
                      "args": {"name": name}}),
        );
        tid
    }

    /// A span measured elsewhere (on a device), on row `tid`.
    pub fn complete(&self, tid: usize, name: &str, ts_us: f64, dur_us: f64, args: Value) {
        let t = &self.timeline;
        t.push(
            json!({"ph": "X", "name": name, "pid": t.pid, "tid": tid, "ts": ts_us,
                      "dur": dur_us, "args": args}),
        );
    }
}

/// A span in progress: written as a complete event when dropped (also on an error's way out).
/// It holds its own handle on the timeline, so the context stays free to change meanwhile.
pub struct Span {
    tracer: Tracer,
    name: String,
    start: f64,
    args: Value,
}

impl Drop for Span {
    fn drop(&mut self) {
        let t = &self.tracer.timeline;
        let dur = t.now_us() - self.start;
        t.push(
            json!({"ph": "X", "name": self.name, "pid": t.pid, "tid": self.tracer.tid,
                      "ts": self.start, "dur": dur, "args": self.args.take()}),
        );
    }
}

/// `tracer.span(name, args())` when tracing, else nothing: the untraced cost is one branch.
pub fn span(tracer: Option<&Tracer>, name: &str, args: impl FnOnce() -> Value) -> Option<Span> {
    tracer.map(|t| t.span(name, args()))
}
