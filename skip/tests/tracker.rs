//! The tracker's lifetimes and portal moves: when each value and gradient is dropped
//! (torchgpipe's tensor-life table and `test_delete_portal_tensor`), what recomputation
//! does, the counts of moves, and the engine-side misuse errors.

use std::sync::{Arc, Mutex};

use skip::{Declaration, Error, Moves, Namespace, Tracker};

/// A value that records its own drop in a shared log; neither `Clone` nor `Copy`.
#[derive(Debug)]
struct Probe {
    id: u32,
    log: Arc<Mutex<Vec<u32>>>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.log.lock().unwrap().push(self.id);
    }
}

struct Lab {
    log: Arc<Mutex<Vec<u32>>>,
}

impl Lab {
    fn new() -> Self {
        Lab {
            log: Arc::default(),
        }
    }
    fn probe(&self, id: u32) -> Probe {
        Probe {
            id,
            log: self.log.clone(),
        }
    }
    fn dropped(&self) -> Vec<u32> {
        self.log.lock().unwrap().clone()
    }
}

const D: Namespace = Namespace::DEFAULT;

fn stash() -> Declaration {
    Declaration::new().stash(["skip"])
}

fn pop() -> Declaration {
    Declaration::new().pop(["skip"])
}

fn run_stash(tracker: &mut Tracker<Probe>, layer: usize, value: Probe, recompute: bool) {
    let decl = stash();
    let skips = if recompute {
        tracker.recompute(layer, &decl).unwrap()
    } else {
        tracker.forward(layer, &decl).unwrap()
    };
    skips.stash("skip", value).unwrap();
    skips.finish().unwrap();
}

/// Pops and returns the popped value's id.
fn run_pop(tracker: &mut Tracker<Probe>, layer: usize, recompute: bool) -> u32 {
    let decl = pop();
    let skips = if recompute {
        tracker.recompute(layer, &decl).unwrap()
    } else {
        tracker.forward(layer, &decl).unwrap()
    };
    let id = skips.pop("skip").unwrap().unwrap().id;
    skips.finish().unwrap();
    id
}

fn move_value(from: &mut Tracker<Probe>, to: &mut Tracker<Probe>) {
    let v = from.take_outgoing(D, "skip").unwrap();
    to.insert_incoming(D, "skip", v).unwrap();
}

fn move_grad(from: &mut Tracker<Probe>, to: &mut Tracker<Probe>) {
    let g = from.take_outgoing_grad(D, "skip").unwrap();
    to.insert_incoming_grad(D, "skip", g).unwrap();
}

fn pop_backward(tracker: &mut Tracker<Probe>, layer: usize, grad: Probe) {
    let decl = pop();
    let mut grads = tracker.backward(layer, &decl).unwrap();
    grads.put_grad("skip", grad).unwrap();
    grads.finish().unwrap();
}

/// Returns the id of the gradient taken (and drops it).
fn stash_backward(tracker: &mut Tracker<Probe>, layer: usize) -> u32 {
    let decl = stash();
    let mut grads = tracker.backward(layer, &decl).unwrap();
    let id = grads.take_grad("skip").unwrap().unwrap().id;
    grads.finish().unwrap();
    id
}

/// Stash in partition 0, pop in partition 1, no checkpointing: the value is dropped when
/// the popping layer's forward pass ends (torchgpipe: life 2, blue -> 1, orange -> 0).
#[test]
fn tensor_life_without_checkpointing() {
    let lab = Lab::new();
    let (mut p0, mut p1) = (Tracker::new(), Tracker::new());
    run_stash(&mut p0, 0, lab.probe(1), false);
    assert!(p0.holds_value(D, "skip"));
    move_value(&mut p0, &mut p1);
    assert!(!p0.holds_value(D, "skip") && p1.holds_value(D, "skip"));
    assert_eq!(run_pop(&mut p1, 1, false), 1);
    assert_eq!(
        lab.dropped(),
        [1],
        "freed at the end of the popping forward pass"
    );
    assert!(p0.is_empty() && p1.is_empty());

    pop_backward(&mut p1, 1, lab.probe(100));
    assert!(p1.holds_grad(D, "skip"));
    move_grad(&mut p1, &mut p0);
    assert!(p1.is_empty() && p0.holds_grad(D, "skip"));
    assert_eq!(stash_backward(&mut p0, 0), 100);
    assert!(p0.is_empty() && p1.is_empty());
    assert_eq!(lab.dropped(), [1, 100]);

    let one_way = Moves {
        values_sent: 1,
        grads_received: 1,
        ..Moves::default()
    };
    assert_eq!(p0.moves(), one_way);
    let other_way = Moves {
        values_received: 1,
        grads_sent: 1,
        ..Moves::default()
    };
    assert_eq!(p1.moves(), other_way);
}

/// The same under checkpointing, in GPipe's order: the popping partition keeps the value
/// for its recomputation (life 3 -> 2 -> 1 -> 0); the stashing partition's recomputation
/// stashes a new value that is dropped at once and replaces nothing.
#[test]
fn tensor_life_with_checkpointing() {
    let lab = Lab::new();
    let (mut p0, mut p1) = (Tracker::with_checkpointing(), Tracker::with_checkpointing());
    run_stash(&mut p0, 0, lab.probe(1), false);
    move_value(&mut p0, &mut p1);
    assert_eq!(run_pop(&mut p1, 1, false), 1);
    assert!(lab.dropped().is_empty(), "kept for the recomputation");
    assert!(p1.holds_value(D, "skip"));

    // Backward of partition 1: recompute, then backward.
    assert_eq!(run_pop(&mut p1, 1, true), 1, "the same value, not a copy");
    assert_eq!(lab.dropped(), [1], "freed after the recomputed pop");
    pop_backward(&mut p1, 1, lab.probe(100));
    move_grad(&mut p1, &mut p0);

    // Backward of partition 0: its recomputation stashes again.
    run_stash(&mut p0, 0, lab.probe(2), true);
    assert_eq!(
        lab.dropped(),
        [1, 2],
        "the recomputed stash is dropped at once"
    );
    assert!(!p0.holds_value(D, "skip") && !p1.holds_value(D, "skip"));
    assert_eq!(p0.moves().recomputed_stashes_dropped, 1);
    assert_eq!(stash_backward(&mut p0, 0), 100);
    assert!(p0.is_empty() && p1.is_empty());
}

/// Stash and pop in one checkpointed tracker (a local skip): nothing is kept past the
/// first pop, because the recomputation stashes again before it pops.
#[test]
fn local_skip_under_checkpointing_is_restashed() {
    let lab = Lab::new();
    let mut t = Tracker::with_checkpointing();
    run_stash(&mut t, 0, lab.probe(1), false);
    assert_eq!(run_pop(&mut t, 1, false), 1);
    assert_eq!(lab.dropped(), [1]);
    assert!(t.is_empty());

    // Recomputing the partition: both layers again, in order.
    run_stash(&mut t, 0, lab.probe(2), true);
    assert_eq!(run_pop(&mut t, 1, true), 2);
    assert_eq!(lab.dropped(), [1, 2]);
    assert_eq!(t.moves(), Moves::default());

    pop_backward(&mut t, 1, lab.probe(100));
    assert_eq!(stash_backward(&mut t, 0), 100);
    assert!(t.is_empty());
}

/// A recomputed stash whose first value is still held does not replace it.
#[test]
fn recomputed_stash_never_replaces_a_held_value() {
    let lab = Lab::new();
    let mut t = Tracker::with_checkpointing();
    run_stash(&mut t, 0, lab.probe(1), false);
    run_stash(&mut t, 0, lab.probe(2), true);
    assert_eq!(lab.dropped(), [2]);
    assert_eq!(t.moves().recomputed_stashes_dropped, 1);
    assert_eq!(run_pop(&mut t, 1, false), 1);
}

#[test]
fn recomputation_needs_checkpointing_and_a_first_pass() {
    let mut t = Tracker::<Probe>::new();
    let err = t.recompute(4, &stash()).err().unwrap();
    assert_eq!(err, Error::NotCheckpointed { layer: 4 });

    let mut t = Tracker::<Probe>::with_checkpointing();
    assert!(t.is_checkpointed() && !Tracker::<Probe>::new().is_checkpointed());
    assert!(matches!(
        t.recompute(0, &stash()).err(),
        Some(Error::NotForwarded { layer: 0, .. })
    ));
    assert!(matches!(
        t.recompute(1, &pop()).err(),
        Some(Error::NotForwarded { layer: 1, .. })
    ));
}

/// A value received under checkpointing is lent to the first pop and to the recomputed
/// pop, and to nobody else.
#[test]
fn retained_value_serves_only_the_recomputation() {
    let lab = Lab::new();
    let mut t = Tracker::with_checkpointing();
    t.insert_incoming(D, "skip", Some(lab.probe(1))).unwrap();
    assert_eq!(run_pop(&mut t, 3, false), 1);
    assert!(matches!(
        t.forward(4, &pop()).err(),
        Some(Error::NotStashed { layer: 4, .. })
    ));
    assert!(matches!(
        t.recompute(4, &pop()).err(),
        Some(Error::NotForwarded { layer: 4, .. })
    ));
    assert_eq!(run_pop(&mut t, 3, true), 1);
    assert!(matches!(
        t.recompute(3, &pop()).err(),
        Some(Error::NotStashed { layer: 3, .. })
    ));
}

/// Stashing nothing crosses partitions too (the engine need not know), and no gradient
/// comes back.
#[test]
fn nothing_crosses_partitions() {
    let (mut p0, mut p1) = (Tracker::<Probe>::new(), Tracker::new());
    let decl = stash();
    let skips = p0.forward(0, &decl).unwrap();
    skips.stash("skip", None).unwrap();
    skips.finish().unwrap();
    let v = p0.take_outgoing(D, "skip").unwrap();
    assert!(v.is_none());
    p1.insert_incoming(D, "skip", v).unwrap();
    let decl = pop();
    let skips = p1.forward(1, &decl).unwrap();
    assert!(skips.pop("skip").unwrap().is_none());
    skips.finish().unwrap();
    p1.backward(1, &decl).unwrap().finish().unwrap();
    let g = p1.take_outgoing_grad(D, "skip").unwrap();
    assert!(g.is_none());
    let lab = Lab::new();
    assert!(matches!(
        p0.insert_incoming_grad(D, "skip", Some(lab.probe(9))),
        Err(Error::UnexpectedGrad { .. })
    ));
    p0.insert_incoming_grad(D, "skip", None).unwrap();
    let decl = stash();
    let mut grads = p0.backward(0, &decl).unwrap();
    assert!(grads.take_grad("skip").unwrap().is_none());
    grads.finish().unwrap();
    assert!(p0.is_empty() && p1.is_empty());
}

#[test]
fn engine_misuse_is_an_error() {
    let lab = Lab::new();
    let (mut p0, mut p1) = (Tracker::new(), Tracker::new());
    assert_eq!(
        p0.take_outgoing(D, "skip").err(),
        Some(Error::NothingToSend {
            ns: D,
            name: "skip".into()
        })
    );
    assert!(matches!(
        p0.insert_incoming_grad(D, "skip", None),
        Err(Error::UnexpectedGrad { .. })
    ));
    run_stash(&mut p0, 0, lab.probe(1), false);
    // The stashing layer cannot ask for the gradient before it came back.
    let decl = stash();
    let mut grads = p0.backward(0, &decl).unwrap();
    assert!(matches!(
        grads.take_grad("skip"),
        Err(Error::GradNotReady { layer: 0, .. })
    ));
    drop(grads);
    move_value(&mut p0, &mut p1);
    assert!(matches!(
        p0.take_outgoing(D, "skip"),
        Err(Error::NothingToSend { .. })
    ));
    assert!(matches!(
        p1.insert_incoming(D, "skip", Some(lab.probe(2))),
        Err(Error::AlreadyHeld { .. })
    ));
    assert!(matches!(
        p1.take_outgoing(D, "skip"),
        Err(Error::NothingToSend { .. })
    ));
    // Not yet backward: no gradient to send.
    run_pop(&mut p1, 1, false);
    assert!(matches!(
        p1.take_outgoing_grad(D, "skip"),
        Err(Error::NoGradToSend { .. })
    ));
    pop_backward(&mut p1, 1, lab.probe(100));
    move_grad(&mut p1, &mut p0);
    assert!(matches!(
        p1.take_outgoing_grad(D, "skip"),
        Err(Error::NoGradToSend { .. })
    ));
    assert!(matches!(
        p0.insert_incoming_grad(D, "skip", Some(lab.probe(4))),
        Err(Error::UnexpectedGrad { .. })
    ));
    assert_eq!(stash_backward(&mut p0, 0), 100);
    assert!(p0.is_empty() && p1.is_empty());
    // Rejected values were handed back to the caller and dropped, none kept.
    assert_eq!(lab.dropped(), [2, 1, 4, 100]);
}

/// A gradient moved for a local skip is refused (it never came from another partition).
#[test]
fn local_gradients_do_not_move() {
    let lab = Lab::new();
    let mut t = Tracker::new();
    run_stash(&mut t, 0, lab.probe(1), false);
    run_pop(&mut t, 1, false);
    pop_backward(&mut t, 1, lab.probe(100));
    assert!(matches!(
        t.take_outgoing_grad(D, "skip"),
        Err(Error::NoGradToSend { .. })
    ));
    assert_eq!(stash_backward(&mut t, 0), 100);
}

/// A tracker can be handed to another thread, and so can the values it gives out.
#[test]
fn trackers_and_moves_cross_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<Tracker<Vec<f64>>>();

    let lab = Lab::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let (gtx, grx) = std::sync::mpsc::channel();
    let mut p0 = Tracker::new();
    run_stash(&mut p0, 0, lab.probe(7), false);
    let id = std::thread::scope(|s| {
        let popper = s.spawn(move || {
            let mut p1 = Tracker::new();
            let v = rx.recv().unwrap();
            p1.insert_incoming(D, "skip", v).unwrap();
            let id = run_pop(&mut p1, 1, false);
            pop_backward(
                &mut p1,
                1,
                Probe {
                    id: 70,
                    log: Arc::default(),
                },
            );
            gtx.send(p1.take_outgoing_grad(D, "skip").unwrap()).unwrap();
            assert!(p1.is_empty());
            id
        });
        tx.send(p0.take_outgoing(D, "skip").unwrap()).unwrap();
        p0.insert_incoming_grad(D, "skip", grx.recv().unwrap())
            .unwrap();
        popper.join().unwrap()
    });
    assert_eq!(id, 7);
    assert_eq!(stash_backward(&mut p0, 0), 70);
    assert!(p0.is_empty());
}

/// `held` lists what an engine counts as memory: values waiting (stashes of nothing left
/// out) and gradients waiting.
#[test]
fn held_lists_waiting_values_and_gradients() {
    let decls = [
        Declaration::new().stash(["a", "none"]),
        Declaration::new().pop(["a", "none"]),
    ];
    let mut t = Tracker::<f64>::new();
    let skips = t.forward(0, &decls[0]).unwrap();
    skips.stash("a", 2.0).unwrap();
    skips.stash("none", None).unwrap();
    skips.finish().unwrap();
    assert_eq!(t.held().copied().collect::<Vec<_>>(), vec![2.0]);
    assert_eq!(
        t.len(),
        2,
        "the stash of nothing is held too, without a value"
    );
    let skips = t.forward(1, &decls[1]).unwrap();
    skips.pop("a").unwrap();
    skips.pop("none").unwrap();
    skips.finish().unwrap();
    assert_eq!(t.held().count(), 0);
    let mut grads = t.backward(1, &decls[1]).unwrap();
    grads.put_grad("a", 5.0).unwrap();
    grads.finish().unwrap();
    assert_eq!(t.held().copied().collect::<Vec<_>>(), vec![5.0]);
    let mut grads = t.backward(0, &decls[0]).unwrap();
    assert_eq!(grads.take_grad("a").unwrap(), Some(5.0));
    assert_eq!(grads.take_grad("none").unwrap(), None);
    grads.finish().unwrap();
    assert_eq!(t.held().count(), 0);
    assert!(t.is_empty());
}
