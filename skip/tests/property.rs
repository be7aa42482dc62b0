//! Property tests over random declaration sequences (a seeded xorshift, no dependency):
//! valid sequences pass `verify` and route every value and gradient to the right layer,
//! on one tracker and pipelined under any balance, with and without checkpointing; each
//! single mutation (drop a pop, duplicate a stash or a pop without a namespace of its
//! own, move a pop before its stash) is caught with exactly the right problems.

use skip::{verify, Declaration, Moves, Namespace, Problem, SkipLayout, Tracker};

const CASES: u64 = 400;
const NAMES: [&str; 4] = ["a", "b", "c", "d"];

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Stash,
    Pop,
}

/// One skip of a valid sequence.
#[derive(Clone, Copy, Debug)]
struct Pair {
    stash: usize,
    pop: usize,
    ns: Namespace,
    name: &'static str,
}

/// A sequence as per-layer lists of (op, name, namespace); a name appears at most once
/// per layer, as a declaration allows.
#[derive(Clone, Debug)]
struct Spec {
    layers: Vec<Vec<(Op, &'static str, Namespace)>>,
}

impl Spec {
    fn decls(&self) -> Vec<Declaration> {
        self.layers
            .iter()
            .map(|ops| {
                let mut d = Declaration::new();
                for &(op, name, ns) in ops {
                    d = match op {
                        Op::Stash => d.stash([name]),
                        Op::Pop => d.pop([name]),
                    };
                    if !ns.is_default() {
                        d = d.isolate_only(ns, [name]);
                    }
                }
                d
            })
            .collect()
    }

    fn uses(&self, layer: usize, name: &str) -> bool {
        self.layers[layer].iter().any(|&(_, n, _)| n == name)
    }

    fn remove(&mut self, layer: usize, op: Op, name: &str) {
        self.layers[layer].retain(|&(o, n, _)| !(o == op && n == name));
    }

    /// Position of a stash among its layer's stashes (rule 4 reports in stash order).
    fn stash_rank(&self, p: &Pair) -> (usize, usize) {
        let pos = self.layers[p.stash]
            .iter()
            .filter(|(op, ..)| *op == Op::Stash)
            .position(|&(_, n, _)| n == p.name)
            .unwrap();
        (p.stash, pos)
    }
}

/// A random valid sequence of 2..=11 layers with up to 7 skips, some sharing a name in
/// separate namespaces.
fn random_valid(rng: &mut Rng) -> (Spec, Vec<Pair>) {
    let n = 2 + rng.below(10);
    let mut spec = Spec {
        layers: vec![Vec::new(); n],
    };
    let mut pairs: Vec<Pair> = Vec::new();
    for _ in 0..rng.below(8) {
        let stash = rng.below(n - 1);
        let pop = stash + 1 + rng.below(n - 1 - stash);
        let name = NAMES[rng.below(NAMES.len())];
        if spec.uses(stash, name) || spec.uses(pop, name) {
            continue;
        }
        let default_free = !pairs.iter().any(|p| p.name == name && p.ns.is_default());
        let ns = if default_free && rng.below(2) == 0 {
            Namespace::DEFAULT
        } else {
            Namespace::new()
        };
        spec.layers[stash].push((Op::Stash, name, ns));
        spec.layers[pop].push((Op::Pop, name, ns));
        pairs.push(Pair {
            stash,
            pop,
            ns,
            name,
        });
    }
    (spec, pairs)
}

fn problems(spec: &Spec) -> Vec<Problem> {
    match verify(&spec.decls()) {
        Ok(()) => Vec::new(),
        Err(e) => e.problems().to_vec(),
    }
}

fn never_popped(p: &Pair) -> Problem {
    Problem::NeverPopped {
        layer: p.stash,
        ns: p.ns,
        name: p.name.into(),
    }
}

/// A layer `u` not in `avoid` that does not use `name`, if any.
fn free_layer(
    rng: &mut Rng,
    spec: &Spec,
    name: &str,
    range: std::ops::Range<usize>,
    avoid: &[usize],
) -> Option<usize> {
    let candidates: Vec<usize> = range
        .filter(|u| !avoid.contains(u) && !spec.uses(*u, name))
        .collect();
    (!candidates.is_empty()).then(|| candidates[rng.below(candidates.len())])
}

#[test]
fn valid_sequences_pass_and_single_mutations_are_caught() {
    let mut applied = [0usize; 5];
    for seed in 0..CASES {
        let mut rng = Rng::new(seed);
        let (spec, pairs) = random_valid(&mut rng);
        assert_eq!(problems(&spec), [], "seed {seed}: {spec:?}");
        if pairs.is_empty() {
            continue;
        }
        let n = spec.layers.len();
        let p = pairs[rng.below(pairs.len())];

        // Drop a pop: the stash is never popped.
        let mut m = spec.clone();
        m.remove(p.pop, Op::Pop, p.name);
        assert_eq!(problems(&m), [never_popped(&p)], "seed {seed}");
        applied[0] += 1;

        // Duplicate the stash elsewhere in the same namespace: the later one clashes.
        if let Some(u) = free_layer(&mut rng, &spec, p.name, 0..n, &[p.stash, p.pop]) {
            let mut m = spec.clone();
            m.layers[u].push((Op::Stash, p.name, p.ns));
            let want = Problem::StashRedeclared {
                layer: u.max(p.stash),
                ns: p.ns,
                name: p.name.into(),
            };
            assert_eq!(problems(&m), [want], "seed {seed}, stash also at {u}");
            applied[1] += 1;
        }

        // Duplicate the pop elsewhere: before the stash it pops nothing; after it, the
        // later of the two pops clashes.
        if let Some(u) = free_layer(&mut rng, &spec, p.name, 0..n, &[p.stash, p.pop]) {
            let mut m = spec.clone();
            m.layers[u].push((Op::Pop, p.name, p.ns));
            let (ns, name) = (p.ns, p.name.to_owned());
            let want = if u < p.stash {
                Problem::PopNotStashed { layer: u, ns, name }
            } else {
                Problem::PopRedeclared {
                    layer: u.max(p.pop),
                    ns,
                    name,
                }
            };
            assert_eq!(problems(&m), [want], "seed {seed}, pop also at {u}");
            applied[2] += 1;
        }

        // Move the pop before its stash: reported there, and the stash is never popped.
        let moved = free_layer(&mut rng, &spec, p.name, 0..p.stash, &[]);
        if let Some(u) = moved {
            let mut m = spec.clone();
            m.remove(p.pop, Op::Pop, p.name);
            m.layers[u].push((Op::Pop, p.name, p.ns));
            let want = [
                Problem::PopNotStashed {
                    layer: u,
                    ns: p.ns,
                    name: p.name.into(),
                },
                never_popped(&p),
            ];
            assert_eq!(problems(&m), want, "seed {seed}, pop moved to {u}");
            applied[3] += 1;

            // Together with a second pair's dropped pop: every problem at once, the
            // never-popped ones in stash order.
            if let Some(q) = pairs.iter().find(|q| (q.ns, q.name) != (p.ns, p.name)) {
                m.remove(q.pop, Op::Pop, q.name);
                let mut tail = [p, *q];
                tail.sort_by_key(|x| spec.stash_rank(x));
                let mut want = vec![want[0].clone()];
                want.extend(tail.iter().map(never_popped));
                assert_eq!(problems(&m), want, "seed {seed}, two mutations");
                applied[4] += 1;
            }
        }
    }
    // Every mutation was exercised often enough to mean something.
    assert!(applied.iter().all(|&k| k >= 50), "applied {applied:?}");
}

/// The value a layer stashes under a name, and the gradient a popping layer hands back.
fn value(layer: usize, name: &str) -> String {
    format!("stashed by {layer} as {name}")
}

fn grad(layer: usize, name: &str) -> String {
    format!("gradient from {layer} for {name}")
}

/// Runs the sequence forward then backward over the layout's partitions, one tracker per
/// partition, moving crossing skips once; every pop must see its own stash's value and
/// every stash its own pop's gradient.
fn run_partitioned(spec: &Spec, pairs: &[Pair], layout: &SkipLayout, checkpointed: bool) {
    let decls = spec.decls();
    let n = layout.num_partitions();
    let mut trackers: Vec<Tracker<String>> = (0..n)
        .map(|_| {
            if checkpointed {
                Tracker::with_checkpointing()
            } else {
                Tracker::new()
            }
        })
        .collect();
    let pair_of =
        |ns: Namespace, name: &str| *pairs.iter().find(|p| (p.ns, p.name) == (ns, name)).unwrap();
    let forward = |t: &mut Tracker<String>, j: usize, recompute: bool| {
        for layer in layout.layers(j) {
            let d = &decls[layer];
            let skips = if recompute {
                t.recompute(layer, d)
            } else {
                t.forward(layer, d)
            }
            .unwrap();
            for (ns, name) in d.poppable() {
                let want = value(pair_of(ns, name).stash, name);
                assert_eq!(skips.pop(name).unwrap(), Some(&want));
            }
            for name in d.stash_names() {
                skips.stash(name, value(layer, name)).unwrap();
            }
            skips.finish().unwrap();
        }
    };
    for j in 0..n {
        for r in layout.copy_policy(j) {
            let v = trackers[r.source].take_outgoing(r.ns, &r.name).unwrap();
            trackers[j].insert_incoming(r.ns, &r.name, v).unwrap();
        }
        forward(&mut trackers[j], j, false);
    }
    for j in (0..n).rev() {
        if checkpointed {
            forward(&mut trackers[j], j, true);
        }
        for layer in layout.layers(j).rev() {
            let d = &decls[layer];
            let mut grads = trackers[j].backward(layer, d).unwrap();
            for name in d.pop_names() {
                grads.put_grad(name, grad(layer, name)).unwrap();
            }
            for (ns, name) in d.stashable() {
                let want = grad(pair_of(ns, name).pop, name);
                assert_eq!(grads.take_grad(name).unwrap(), Some(want));
            }
            grads.finish().unwrap();
        }
        for r in layout.copy_policy(j) {
            let g = trackers[j].take_outgoing_grad(r.ns, &r.name).unwrap();
            trackers[r.source]
                .insert_incoming_grad(r.ns, &r.name, g)
                .unwrap();
        }
    }
    assert!(trackers.iter().all(Tracker::is_empty));
    let crossing = pairs
        .iter()
        .filter(|p| layout.requires_copy(p.ns, p.name))
        .count();
    let moves: Moves = trackers.iter().map(Tracker::moves).sum();
    let dropped = if checkpointed { crossing } else { 0 };
    let want = Moves {
        values_sent: crossing,
        values_received: crossing,
        grads_sent: crossing,
        grads_received: crossing,
        recomputed_stashes_dropped: dropped,
    };
    assert_eq!(moves, want);
}

#[test]
fn valid_sequences_route_values_and_gradients_under_any_balance() {
    for seed in 0..CASES {
        let mut rng = Rng::new(1000 + seed);
        let (spec, pairs) = random_valid(&mut rng);
        let decls = spec.decls();
        // A random balance: cut the layers at random places.
        let n = decls.len();
        let mut balance = Vec::new();
        let mut start = 0;
        while start < n {
            let size = 1 + rng.below(n - start);
            balance.push(size);
            start += size;
        }
        let layout = SkipLayout::new(&decls, &balance).unwrap();
        for j in 0..layout.num_partitions() {
            let policy = layout.copy_policy(j);
            assert!(policy.iter().all(|r| r.source < j && r.dest == j));
            assert!(policy
                .windows(2)
                .all(|w| (w[0].source, w[0].ns, &w[0].name) < (w[1].source, w[1].ns, &w[1].name)));
        }
        for p in &pairs {
            let r = layout.route(p.ns, p.name).unwrap();
            assert_eq!((r.stash_layer, r.pop_layer), (p.stash, p.pop));
            assert_eq!(layout.partition_of_layer(p.stash), Some(r.source));
            assert_eq!(layout.partition_of_layer(p.pop), Some(r.dest));
        }
        assert_eq!(layout.routes().count(), pairs.len());
        run_partitioned(&spec, &pairs, &layout, false);
        run_partitioned(&spec, &pairs, &layout, true);
        // One partition: the plain sequence.
        let single = SkipLayout::new(&decls, &[n]).unwrap();
        run_partitioned(&spec, &pairs, &single, false);
    }
}
