//! Stash and pop at run time: torchgpipe's `test_stash_pop.py` ported (the run-time
//! errors, stashing nothing), the seed's `1to3` and `StashStashPop` examples forward and
//! backward, and namespaces at run time.

use skip::{Declaration, Error, Namespace, Tracker};

/// A value that is neither `Clone` nor `Copy`: the tracker must never need either.
#[derive(Debug, PartialEq)]
struct Opaque(i64);

fn d() -> Namespace {
    Namespace::DEFAULT
}

#[test]
fn stash() {
    let decl = Declaration::new().stash(["foo"]);
    let mut tracker = Tracker::new();
    assert_eq!(tracker.len(), 0);
    let skips = tracker.forward(0, &decl).unwrap();
    skips.stash("foo", Opaque(42)).unwrap();
    skips.finish().unwrap();
    assert_eq!(tracker.len(), 1);
    assert!(tracker.holds_value(d(), "foo"));
}

#[test]
fn pop() {
    let (s, p) = (
        Declaration::new().stash(["foo"]),
        Declaration::new().pop(["foo"]),
    );
    let mut tracker = Tracker::new();
    let skips = tracker.forward(0, &s).unwrap();
    skips.stash("foo", Opaque(42)).unwrap();
    skips.finish().unwrap();
    let skips = tracker.forward(1, &p).unwrap();
    assert_eq!(skips.pop("foo").unwrap(), Some(&Opaque(42)));
    skips.finish().unwrap();
    assert!(tracker.is_empty(), "popped and finished: released");
}

#[test]
fn declare_but_not_use() {
    let (s, p) = (
        Declaration::new().stash(["foo"]),
        Declaration::new().pop(["foo"]),
    );
    let mut tracker = Tracker::<Opaque>::new();
    let err = tracker.forward(0, &s).unwrap().finish().unwrap_err();
    assert_eq!(
        err,
        Error::MustBeStashed {
            layer: 0,
            names: vec![(d(), "foo".into())]
        }
    );
    assert!(err
        .to_string()
        .contains("'foo' in the default namespace must be stashed but have not"));
    assert!(tracker.is_empty(), "a failed layer commits nothing");

    // With the value there, a pop layer that does not pop fails likewise.
    tracker
        .insert_incoming(d(), "foo", Some(Opaque(1)))
        .unwrap();
    let err = tracker.forward(1, &p).unwrap().finish().unwrap_err();
    assert!(matches!(err, Error::MustBePopped { layer: 1, .. }), "{err}");
    assert!(err.to_string().contains("must be popped but have not"));
    assert!(
        tracker.holds_value(d(), "foo"),
        "a failed layer releases nothing"
    );
}

#[test]
fn stash_not_declared() {
    let mut tracker = Tracker::new();
    let nothing = Declaration::new();
    let skips = tracker.forward(3, &nothing).unwrap();
    let err = skips.stash("foo", Opaque(42)).unwrap_err();
    assert_eq!(
        err,
        Error::NotDeclaredStashable {
            layer: 3,
            ns: d(),
            name: "foo".into()
        }
    );
    assert_eq!(
        err.to_string(),
        "layer 3: 'foo' in the default namespace has not been declared as stashable"
    );
}

#[test]
fn pop_not_declared() {
    let s = Declaration::new().stash(["foo"]);
    let mut tracker = Tracker::new();
    let skips = tracker.forward(0, &s).unwrap();
    skips.stash("foo", Opaque(42)).unwrap();
    skips.finish().unwrap();
    let nothing = Declaration::new();
    let skips = tracker.forward(1, &nothing).unwrap();
    let err = skips.pop("foo").unwrap_err();
    assert!(matches!(err, Error::NotDeclaredPoppable { layer: 1, .. }));
    assert!(err
        .to_string()
        .contains("'foo' in the default namespace has not been declared as poppable"));
}

#[test]
fn pop_not_stashed() {
    let p = Declaration::new().pop(["foo"]);
    let mut tracker = Tracker::<Opaque>::new();
    let err = tracker.forward(0, &p).err().unwrap();
    assert_eq!(
        err.to_string(),
        "layer 0: 'foo' in the default namespace has not been stashed"
    );
}

/// torchgpipe's `test_stash_none`, plus what follows: the pop gets `None`, no gradient
/// can be handed in, the stashing layer gets none back.
#[test]
fn stash_none() {
    let (s, p) = (
        Declaration::new().stash(["foo"]),
        Declaration::new().pop(["foo"]),
    );
    let mut tracker = Tracker::<Opaque>::new();
    let skips = tracker.forward(0, &s).unwrap();
    skips.stash("foo", None).unwrap();
    skips.finish().unwrap();
    assert!(
        tracker.holds_value(d(), "foo"),
        "a stash of nothing is still a stash"
    );
    let skips = tracker.forward(1, &p).unwrap();
    assert_eq!(skips.pop("foo").unwrap(), None);
    skips.finish().unwrap();

    let mut grads = tracker.backward(1, &p).unwrap();
    let err = grads.put_grad("foo", Opaque(1)).unwrap_err();
    assert!(
        matches!(err, Error::GradOfNothing { layer: 1, .. }),
        "{err}"
    );
    grads.finish().unwrap();
    let mut grads = tracker.backward(0, &s).unwrap();
    assert_eq!(grads.take_grad("foo").unwrap(), None);
    grads.finish().unwrap();
    assert!(tracker.is_empty());
}

#[test]
fn stashing_or_popping_twice_in_one_pass_fails() {
    let (s, p) = (
        Declaration::new().stash(["foo"]),
        Declaration::new().pop(["foo"]),
    );
    let mut tracker = Tracker::new();
    let skips = tracker.forward(0, &s).unwrap();
    skips.stash("foo", Opaque(1)).unwrap();
    let err = skips.stash("foo", Opaque(2)).unwrap_err();
    assert!(matches!(err, Error::StashedTwice { layer: 0, .. }), "{err}");
    skips.finish().unwrap();
    // A second layer stashing the same key in the same micro-batch (what `verify` rejects
    // statically) is caught at run time too.
    let skips = tracker.forward(1, &s).unwrap();
    let err = skips.stash("foo", Opaque(3)).unwrap_err();
    assert!(matches!(err, Error::StashedTwice { layer: 1, .. }), "{err}");
    drop(skips);

    let skips = tracker.forward(2, &p).unwrap();
    assert_eq!(skips.pop("foo").unwrap(), Some(&Opaque(1)));
    let err = skips.pop("foo").unwrap_err();
    assert!(matches!(err, Error::PoppedTwice { layer: 2, .. }), "{err}");
    skips.finish().unwrap();
    // And a second popping layer finds nothing.
    assert!(matches!(
        tracker.forward(3, &p).err(),
        Some(Error::NotStashed { layer: 3, .. })
    ));
}

/// The seed's example: layer 1 stashes its input as `1to3`, layer 3 adds it to its
/// output; forward and backward on scalars, against the closed form.
#[test]
fn one_to_three() {
    let decls = [
        Declaration::new().stash(["1to3"]),
        Declaration::new(),
        Declaration::new().pop(["1to3"]),
    ];
    skip::verify(&decls).unwrap();
    let (f1, f2, f3) = (3.0, 5.0, 7.0); // f_k(x) = f_k * x
    let x = 2.0;

    let mut tracker = Tracker::<f64>::new();
    let skips = tracker.forward(0, &decls[0]).unwrap();
    skips.stash("1to3", x).unwrap();
    let h1 = f1 * x;
    skips.finish().unwrap();
    let h2 = f2 * h1; // layer 2 never touches the tracker
    let skips = tracker.forward(2, &decls[2]).unwrap();
    let y = f3 * h2 + skips.pop("1to3").unwrap().copied().unwrap();
    skips.finish().unwrap();
    assert_eq!(y, 7.0 * 5.0 * 3.0 * 2.0 + 2.0);

    // dL/dy = 1.
    let mut grads = tracker.backward(2, &decls[2]).unwrap();
    grads.put_grad("1to3", 1.0).unwrap();
    let g2 = f3 * 1.0;
    grads.finish().unwrap();
    let g1 = f2 * g2;
    let mut grads = tracker.backward(0, &decls[0]).unwrap();
    let gx = f1 * g1 + grads.take_grad("1to3").unwrap().unwrap();
    grads.finish().unwrap();
    assert_eq!(gx, 3.0 * 5.0 * 7.0 + 1.0);
    assert!(tracker.is_empty());
}

/// The seed's `StashStashPop`: one layer stashes two names and pops a third.
/// Layer 0 stashes `carol = 10 x` and returns `x`; layer 1 stashes `alice = 2 h` and
/// `bob = 3 h` and returns `h + carol`; layer 2 returns `h + alice * bob`.
/// So `y = 11 x + 6 x^2` and `dy/dx = 11 + 12 x`.
#[test]
fn stash_stash_pop() {
    let decls = stash_stash_pop_decls();
    skip::verify(&decls).unwrap();
    let x = 1.5;
    let mut tracker = Tracker::<f64>::new();

    let skips = tracker.forward(0, &decls[0]).unwrap();
    skips.stash("carol", 10.0 * x).unwrap();
    skips.finish().unwrap();
    let h = x;

    let skips = tracker.forward(1, &decls[1]).unwrap();
    skips.stash("alice", 2.0 * h).unwrap();
    let carol: &f64 = skips.pop("carol").unwrap().unwrap(); // lent...
    skips.stash("bob", 3.0 * h).unwrap(); // ...while the layer stashes: any order
    let h = h + carol;
    skips.finish().unwrap();
    assert_eq!(tracker.len(), 2, "alice and bob held, carol released");

    let skips = tracker.forward(2, &decls[2]).unwrap();
    // Pop order need not follow declaration order; both borrows live at once.
    let bob = skips.pop("bob").unwrap().unwrap();
    let alice = skips.pop("alice").unwrap().unwrap();
    let y = h + alice * bob;
    skips.finish().unwrap();
    assert_eq!(y, 11.0 * x + 6.0 * x * x);

    // Backward with dL/dy = 1.
    let (alice, bob) = (2.0 * x, 3.0 * x);
    let mut grads = tracker.backward(2, &decls[2]).unwrap();
    grads.put_grad("alice", bob).unwrap(); // d(alice * bob)/dalice
    grads.put_grad("bob", alice).unwrap();
    grads.finish().unwrap();
    let gh = 1.0;

    let mut grads = tracker.backward(1, &decls[1]).unwrap();
    let galice = grads.take_grad("alice").unwrap().unwrap();
    let gbob = grads.take_grad("bob").unwrap().unwrap();
    grads.put_grad("carol", gh).unwrap(); // d(h + carol)/dcarol
    grads.finish().unwrap();
    let gh = gh + 2.0 * galice + 3.0 * gbob; // through h, alice and bob

    let mut grads = tracker.backward(0, &decls[0]).unwrap();
    let gx = gh + 10.0 * grads.take_grad("carol").unwrap().unwrap();
    grads.finish().unwrap();
    assert_eq!(gx, 11.0 + 12.0 * x);
    assert!(tracker.is_empty());
}

fn stash_stash_pop_decls() -> [Declaration; 3] {
    [
        Declaration::new().stash(["carol"]),
        Declaration::new().stash(["alice", "bob"]).pop(["carol"]),
        Declaration::new().pop(["alice", "bob"]),
    ]
}

/// A stashing layer's backward pass that forgets a gradient fails instead of losing it;
/// a popping layer's backward pass runs once.
#[test]
fn forgotten_gradient_and_second_backward_are_caught() {
    let decls = stash_stash_pop_decls();
    let mut tracker = Tracker::<f64>::new();
    for (i, decl) in decls.iter().enumerate() {
        let skips = tracker.forward(i, decl).unwrap();
        for name in decl.pop_names() {
            skips.pop(name).unwrap();
        }
        for name in decl.stash_names() {
            skips.stash(name, 1.0).unwrap();
        }
        skips.finish().unwrap();
    }
    let mut grads = tracker.backward(2, &decls[2]).unwrap();
    grads.put_grad("alice", 1.0).unwrap();
    grads.put_grad("bob", 1.0).unwrap();
    grads.finish().unwrap();
    assert!(matches!(
        tracker.backward(2, &decls[2]).err(),
        Some(Error::BackwardTwice { layer: 2, .. })
    ));

    let mut grads = tracker.backward(1, &decls[1]).unwrap();
    grads.take_grad("alice").unwrap();
    assert_eq!(
        grads.finish().unwrap_err(),
        Error::GradNotTaken {
            layer: 1,
            names: vec![(Namespace::DEFAULT, "bob".into())]
        }
    );
    assert!(
        tracker.holds_grad(Namespace::DEFAULT, "bob"),
        "still there to take"
    );
}

/// Gradients must wait for the popping layer's backward pass.
#[test]
fn gradient_before_the_pops_backward_is_not_ready() {
    let (s, p) = (
        Declaration::new().stash(["foo"]),
        Declaration::new().pop(["foo"]),
    );
    let mut tracker = Tracker::new();
    let skips = tracker.forward(0, &s).unwrap();
    skips.stash("foo", Opaque(1)).unwrap();
    skips.finish().unwrap();
    let skips = tracker.forward(1, &p).unwrap();
    skips.pop("foo").unwrap();
    skips.finish().unwrap();

    let mut grads = tracker.backward(0, &s).unwrap();
    let err = grads.take_grad("foo").unwrap_err();
    assert!(matches!(err, Error::GradNotReady { layer: 0, .. }), "{err}");
    drop(grads);
    assert!(matches!(
        tracker.backward(2, &p).err(),
        Some(Error::NotForwarded { layer: 2, .. })
    ));

    let mut grads = tracker.backward(1, &p).unwrap();
    grads.put_grad("foo", Opaque(5)).unwrap();
    let err = grads.put_grad("foo", Opaque(6)).unwrap_err();
    assert!(matches!(err, Error::GradTwice { layer: 1, .. }), "{err}");
    grads.finish().unwrap();
    assert!(tracker.holds_grad(d(), "foo"));

    let mut grads = tracker.backward(0, &s).unwrap();
    assert_eq!(grads.take_grad("foo").unwrap(), Some(Opaque(5)));
    let err = grads.take_grad("foo").unwrap_err();
    assert!(
        matches!(err, Error::GradAlreadyTaken { layer: 0, .. }),
        "{err}"
    );
    assert!(matches!(
        grads.take_grad("bar"),
        Err(Error::NotDeclaredStashable { .. })
    ));
    grads.finish().unwrap();
    assert!(tracker.is_empty());
}

/// A popping layer may hand no gradient in (its value did not reach the loss); the
/// stashing layer then gets `None` instead of a failure (pytorch/pytorch#110775).
#[test]
fn no_gradient_handed_in_is_none() {
    let (s, p) = (
        Declaration::new().stash(["foo"]),
        Declaration::new().pop(["foo"]),
    );
    let mut tracker = Tracker::new();
    let skips = tracker.forward(0, &s).unwrap();
    skips.stash("foo", Opaque(1)).unwrap();
    skips.finish().unwrap();
    let skips = tracker.forward(1, &p).unwrap();
    skips.pop("foo").unwrap();
    skips.finish().unwrap();
    tracker.backward(1, &p).unwrap().finish().unwrap();
    let mut grads = tracker.backward(0, &s).unwrap();
    assert_eq!(grads.take_grad("foo").unwrap(), None);
    grads.finish().unwrap();
    assert!(tracker.is_empty());
}

/// One block type used twice: isolated, the same name makes two skips; not isolated,
/// the second stash clashes at run time as `verify` says statically.
#[test]
fn namespaces_keep_one_name_apart() {
    let (ns1, ns2) = (Namespace::new(), Namespace::new());
    let encoder = |ns| Declaration::new().stash(["skip"]).isolate(ns);
    let decoder = |ns| Declaration::new().pop(["skip"]).isolate(ns);
    let decls = [encoder(ns1), encoder(ns2), decoder(ns2), decoder(ns1)];
    skip::verify(&decls).unwrap();

    let mut tracker = Tracker::new();
    for (i, decl) in decls[..2].iter().enumerate() {
        let skips = tracker.forward(i, decl).unwrap();
        skips.stash("skip", Opaque(i as i64)).unwrap();
        skips.finish().unwrap();
    }
    assert!(tracker.holds_value(ns1, "skip") && tracker.holds_value(ns2, "skip"));
    assert!(!tracker.holds_value(Namespace::DEFAULT, "skip"));
    let mut got = Vec::new();
    for (i, decl) in decls.iter().enumerate().skip(2) {
        let skips = tracker.forward(i, decl).unwrap();
        got.push(skips.pop("skip").unwrap().map(|o| o.0));
        skips.finish().unwrap();
    }
    assert_eq!(got, [Some(1), Some(0)], "nested: the inner pair first");

    let plain = Declaration::new().stash(["skip"]);
    let mut tracker = Tracker::new();
    let skips = tracker.forward(0, &plain).unwrap();
    skips.stash("skip", Opaque(0)).unwrap();
    skips.finish().unwrap();
    let skips = tracker.forward(1, &plain).unwrap();
    assert_eq!(
        skips.stash("skip", Opaque(1)).unwrap_err(),
        Error::StashedTwice {
            layer: 1,
            ns: Namespace::DEFAULT,
            name: "skip".into()
        }
    );
}

/// Errors about isolated names give their namespace.
#[test]
fn runtime_errors_name_the_namespace() {
    let ns = Namespace::new();
    let p = Declaration::new().pop(["foo"]).isolate(ns);
    let mut tracker = Tracker::<Opaque>::new();
    // Stashed, but in the default namespace: not the same skip.
    tracker
        .insert_incoming(Namespace::DEFAULT, "foo", Some(Opaque(0)))
        .unwrap();
    let err = tracker.forward(5, &p).err().unwrap();
    assert_eq!(
        err,
        Error::NotStashed {
            layer: 5,
            ns,
            name: "foo".into()
        }
    );
    assert_eq!(
        err.to_string(),
        format!(
            "layer 5: 'foo' in namespace #{} has not been stashed",
            ns.id()
        )
    );
}
