//! Running a call on every rank and one rank's deviation from it: what each rank calls and
//! registers, and the outcome every rank must see.

use super::*;

impl World<'_> {
    /// Runs `std` on every rank (the deviating rank its own call), checks every rank's outcome
    /// and that a failure changed nothing; after a deviation undoes it, and after a failure
    /// calls `retry` and `std` again, which must work. Whether `std` succeeded (the caller
    /// then updates the model and checks the values).
    pub(super) fn run(
        &mut self,
        std: &mut Call,
        e: Expect,
        dev: Option<Dev>,
        retry: &mut dyn FnMut(&mut Self),
    ) -> bool {
        if let Some(r) = self.dying {
            return self.lost_at(std, r, retry);
        }
        let mine = match &dev {
            Some(d) if d.rank == self.rank => d.call.clone().unwrap_or(std.clone()),
            _ => std.clone(),
        };
        let e = dev.as_ref().map_or(e, |d| d.expect.clone());
        let how = dev.as_ref().map_or(String::new(), |d| {
            format!("; rank {} deviates ({}): {:?}", d.rank, d.class, d.call)
        });
        self.note(format!("{std:?}{how}, expecting {e:?}"));
        self.tally.calls += 1;
        let st = mine.invoke(&self.ctx);
        self.expect(st, &e, &format!("{mine:?}"));
        let temps = dev.as_ref().map_or(&[][..], |d| &d.temps);
        if st == OK {
            self.check_temps(temps);
            self.tally.count(std.function());
        } else {
            self.check_unchanged(&format!("after {mine:?} failed"), temps);
            self.tally.failed += 1;
        }
        let step = matches!(std, Call::Grads(_) | Call::Scatter(_));
        if st == OK && step {
            self.agreed.fill(true);
        }
        let Some(dev) = dev else {
            return st == OK;
        };
        self.tally.count(dev.class);
        for t in &dev.temps {
            self.ok(self.ctx.unregister(t.name), "unregistering a temporary");
        }
        if dev.sparse_extra && dev.rank == self.rank {
            self.ok(self.ctx.unregister("emb_x"), "unregistering emb_x");
        }
        dev.registered.iter().for_each(|&r| self.agreed[r] = false);
        if st == OK {
            return true;
        }
        retry(self);
        self.note(format!("{std:?} again, without the deviation"));
        self.tally.calls += 1;
        let st = std.invoke(&self.ctx);
        self.ok(st, "the same call again, without the deviation");
        self.tally.count(std.function());
        if step {
            self.agreed.fill(true);
        }
        true
    }

    /// Now and then a deviation of one rank from `std` (which would succeed), of one of
    /// `classes`; registrations it needs are made here. `bad`: (gradient, world replica) pairs
    /// that can take a bad index.
    pub(super) fn draw_dev(
        &mut self,
        std: &Call,
        classes: &[&'static str],
        bad: &[(usize, usize)],
    ) -> Option<Dev> {
        // Not at a leave or a kill (drawn alike: every rank in the call knows), nor in a world of one
        // rank (left after leaves: nothing to differ from).
        if self.leaving || self.dying.is_some() || self.per_rank.len() < 2 {
            return None;
        }
        let sparse = self.cfg.on("sparse");
        let classes: Vec<&'static str> = (classes.iter().copied())
            .filter(|c| self.cfg.on(c) && (sparse || !c.starts_with("sparse")))
            .filter(|&c| {
                (c != "benign" || std.involved() != 0xf) && (c != "sparse_index" || !bad.is_empty())
            })
            // `local` needs a rank of several replicas.
            .filter(|&c| c != "local" || self.per_rank.iter().any(|&r| r > 1))
            .collect();
        if self.below(100) >= 35 || classes.is_empty() {
            return None;
        }
        let (class, d, pick) = (
            self.pick(&classes),
            self.below(self.per_rank.len()),
            self.below(4),
        );
        let mut dev = Dev {
            class,
            rank: d,
            ..Dev::default()
        };
        // Where calls differ, the message names rank 0's and the first other rank's.
        let first = format!("rank {}", d.max(1));
        let differ = |n: &[&str]| all(INCONSISTENT, &[n, &[first.as_str()]].concat());
        let (call, expect) = match (class, std) {
            ("op", Call::Grads(op) | Call::Allreduce(_, op) | Call::Scatter(op)) => {
                (std.with(1 - op), differ(&["op=Sum", "op=Avg"]))
            }
            ("name", Call::Allreduce(Some(name), op)) => {
                let others: Vec<String> = (self.dense.iter().map(|t| t.name.clone()))
                    .filter(|n| n != name)
                    .collect();
                match others.get(pick) {
                    Some(o) => {
                        let e = differ(&[&format!("name='{name}'"), &format!("name='{o}'")]);
                        (Call::Allreduce(Some(o.clone()), *op), e)
                    }
                    None => (
                        Call::Allreduce(Some("nope".into()), *op),
                        own(d, NOT_FOUND, &["'nope'"]),
                    ),
                }
            }
            ("root", Call::Broadcast(roles, root)) if pick < 3 => {
                let other = (root + 1 + pick % (self.total - 1)) % self.total;
                let e = differ(&[&format!("root={root})"), &format!("root={other})")]);
                (Call::Broadcast(*roles, other), e)
            }
            ("root", Call::Broadcast(roles, _)) => {
                let e = own(d, INVALID_ARGUMENT, &["root_replica"]);
                (Call::Broadcast(*roles, self.total + pick), e)
            }
            (
                "roles",
                Call::Broadcast(roles, _) | Call::Average(roles) | Call::Allgather(roles),
            ) => {
                let other = 1 + (roles + pick as u32) % 15;
                let e = differ(&[&format!("roles={roles:#x}"), &format!("roles={other:#x}")]);
                (std.with(other), e)
            }
            ("bmuf_args", &Call::BmufInit(lr, mu, nesterov)) => match pick {
                0 => (Call::BmufInit(0.5, mu, nesterov), differ(&["block_lr=0.5"])),
                1 => {
                    let e = differ(&[&format!("nesterov={}", !nesterov)]);
                    (Call::BmufInit(lr, mu, !nesterov), e)
                }
                p => {
                    let bad = if p == 2 { 1.5 } else { f64::NAN };
                    let e = own(d, INVALID_ARGUMENT, &["block_momentum"]);
                    (Call::BmufInit(lr, bad, nesterov), e)
                }
            },
            ("boundary", _) => {
                let roles = [0, 0x10, 0x8000_0001][pick % 3];
                let (call, arg) = match std {
                    Call::Grads(_) => (Call::Grads(7), "op"),
                    Call::Scatter(_) => (Call::Scatter(7), "op"),
                    Call::Allgather(_) => (Call::Allgather(roles), "roles"),
                    Call::Allreduce(n, _) if pick < 2 => (Call::Allreduce(n.clone(), 7), "op"),
                    Call::Allreduce(_, op) => (Call::Allreduce(None, *op), "name"),
                    Call::Broadcast(_, root) => (Call::Broadcast(roles, *root), "roles"),
                    Call::Average(_) => (Call::Average(roles), "roles"),
                    &Call::BmufInit(_, mu, n) => (Call::BmufInit(f64::NAN, mu, n), "block_lr"),
                    Call::BmufStep => unreachable!("dpsync_bmuf_step takes no argument"),
                };
                (call, own(d, INVALID_ARGUMENT, &[arg]))
            }
            ("call", _) => {
                let other = match std {
                    Call::Broadcast(..) => Call::Average(COMPUTED),
                    // The step's other shape: it may finish buckets started early too.
                    Call::Scatter(op) => Call::Grads(*op),
                    _ => Call::Broadcast(PARAM | STATE, 0),
                };
                let e = differ(&[std.function(), other.function()]);
                (other, e)
            }
            ("register" | "local" | "benign", _) => {
                self.dev_register(&mut dev, std);
                return Some(dev);
            }
            ("sparse_extra", _) => {
                dev.sparse_extra = true;
                let e = all(INCONSISTENT, &["'emb_x'", &format!("rank {d}")]);
                (std.clone(), e)
            }
            ("sparse_index", _) => {
                let (s, w) = bad[pick % bad.len()];
                let offset = |r: usize| self.per_rank[..r].iter().sum::<usize>();
                dev.rank = (0..self.per_rank.len())
                    .rfind(|&r| offset(r) <= w)
                    .expect("a rank");
                let k = w - offset(dev.rank);
                let v = [self.sparse[s].num_emb as i64, -1][pick % 2];
                dev.bad = Some((s, k, v));
                // CUDA replicas check indices on the device: the step succeeds everywhere, and
                // the rank's next dpsync_synchronize reports it (checked in `grads`).
                let e = match self.setup.at.cuda() {
                    true => Expect::Ok,
                    false => own(dev.rank, INCONSISTENT, &[&format!("index {v}")]),
                };
                (std.clone(), e)
            }
            _ => unreachable!("class {class} for {std:?}"),
        };
        (dev.call, dev.expect) = (Some(call), expect);
        Some(dev)
    }

    /// Registrations that differ between ranks (`register`), between the replicas of one rank
    /// (`local`), or that the call does not involve (`benign`), of a role `std` involves (does
    /// not, for `benign`).
    pub(super) fn dev_register(&mut self, dev: &mut Dev, std: &Call) {
        let (involved, benign) = (std.involved(), dev.class == "benign");
        let roles: Vec<u32> = (ROLES.iter().copied())
            .filter(|r| (r & involved != 0) != benign)
            .collect();
        let role = self.pick(&roles);
        // PARAMs floating-point: an integer one would refuse dpsync_bmuf_init on its own.
        let dtypes: &[DType] = if role == PARAM { &FLOATS } else { &DType::ALL };
        let i = self.below(dtypes.len());
        let (dtype, other) = (dtypes[i], dtypes[(i + 1) % dtypes.len()]);
        let (count, variant) = (self.pick(&COUNTS[..5]), self.below(4));
        // `local`: a rank with several replicas, registering on some of them.
        let several: Vec<usize> = (0..self.per_rank.len())
            .filter(|&r| self.per_rank[r] > 1)
            .collect();
        // Drawn alike on every rank (the layout is every rank's).
        let local_rank = match several.is_empty() {
            true => dev.rank,
            false => self.pick(&several),
        };
        if dev.class == "local" {
            dev.rank = local_rank;
        }
        let d = dev.rank;
        let part = 1 + self.below(self.per_rank[d].max(2) - 1);
        let first = format!("rank {}", d.max(1));
        let (l, me) = (self.local, self.rank == d);
        let every: Vec<usize> = (0..self.per_rank.len()).collect();
        let bmuf_step = matches!(std, Call::BmufStep);
        // (name, dtype, count, replicas) for this rank, the ranks registering, the outcome.
        let (regs, who, e) = match (dev.class, variant) {
            ("benign", _) => (vec![("dev_x", dtype, count, l)], vec![d], Expect::Ok),
            ("local", _) => {
                dev.local_grad = role == GRAD;
                let e = own(d, INCONSISTENT, &["'dev_x'"]);
                (vec![("dev_x", dtype, count, part)], vec![d], e)
            }
            (_, 0) => {
                let e = match bmuf_step {
                    true => own(d, INVALID_STATE, &["'dev_x'"]),
                    false => all(INCONSISTENT, &["'dev_x'", &format!("rank {d}")]),
                };
                (vec![("dev_x", dtype, count, l)], vec![d], e)
            }
            (_, 1 | 2) => {
                let (dt, n) = match (me, variant) {
                    (true, 1) => (dtype, count + 1),
                    (true, _) => (other, count),
                    _ => (dtype, count),
                };
                let e = match bmuf_step {
                    true => all(INVALID_STATE, &["'dev_"]),
                    false => all(INCONSISTENT, &["'dev_x'", &first]),
                };
                (vec![("dev_x", dt, n, l)], every, e)
            }
            _ => {
                let mut regs = vec![("dev_x", dtype, count, l), ("dev_y", dtype, count, l)];
                if me {
                    regs.reverse();
                }
                let e = match bmuf_step {
                    true => all(INVALID_STATE, &["'dev_"]),
                    false => all(INCONSISTENT, &["order", &first]),
                };
                (regs, every, e)
            }
        };
        dev.expect = e;
        let here = who.contains(&self.rank);
        for (name, dtype, count, replicas) in regs.into_iter().filter(|_| here) {
            let vals: Vec<f64> = (0..count).map(|i| (i % 3) as f64).collect();
            let mut bufs: Vec<Store> = (0..replicas)
                .map(|k| self.setup.at.put(k, make_buf(dtype, &vals, 1)))
                .collect();
            for (k, b) in bufs.iter_mut().enumerate() {
                let st = register_raw(self.ctx.0, name, role, k, b.ptr(), count, dtype.code());
                self.ok(st, "registering a temporary");
            }
            dev.temps.push(Temp { name, bufs });
        }
        who.iter().for_each(|&r| self.agreed[r] = false);
        dev.registered = who;
    }
}
