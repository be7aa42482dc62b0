//! torchgpipe's `test_inspect_skip_layout.py`, ported: copy policies and their order;
//! plus the balance checks and the layout queries a pipeline engine uses.

use skip::{Declaration, Error, Namespace, Problem, SkipLayout};

fn pass() -> Declaration {
    Declaration::new()
}

fn stash_foo() -> Declaration {
    Declaration::new().stash(["foo"])
}

fn pop_foo() -> Declaration {
    Declaration::new().pop(["foo"])
}

fn stash_bar() -> Declaration {
    Declaration::new().stash(["bar"])
}

fn pop_bar() -> Declaration {
    Declaration::new().pop(["bar"])
}

/// Every partition's copy policy as `(source, namespace, name)`, torchgpipe's tuples.
fn policy(decls: &[Declaration], balance: &[usize]) -> Vec<Vec<(usize, Namespace, String)>> {
    let layout = SkipLayout::new(decls, balance).unwrap();
    (0..layout.num_partitions())
        .map(|j| {
            layout
                .copy_policy(j)
                .iter()
                .map(|r| {
                    assert_eq!(r.dest, j);
                    (r.source, r.ns, r.name.clone())
                })
                .collect()
        })
        .collect()
}

const NONE: Namespace = Namespace::DEFAULT;

#[test]
fn no_skippables() {
    assert_eq!(policy(&[pass(), pass()], &[1, 1]), [vec![], vec![]]);
}

#[test]
fn inner_partition() {
    let decls = [stash_foo(), pop_foo(), pass()];
    assert_eq!(policy(&decls, &[2, 1]), [vec![], vec![]]);
    let layout = SkipLayout::new(&decls, &[2, 1]).unwrap();
    assert!(!layout.requires_copy(NONE, "foo"));
    assert_eq!(layout.partition_of_stash(NONE, "foo"), Some(0));
    assert_eq!(layout.local(0).len(), 1);
    assert_eq!(layout.local(0)[0].name, "foo");
    assert!(layout.local(1).is_empty());
}

#[test]
fn adjoining_partitions() {
    assert_eq!(
        policy(&[stash_foo(), pop_foo()], &[1, 1]),
        [vec![], vec![(0, NONE, "foo".to_owned())]]
    );
}

#[test]
fn far_partitions() {
    assert_eq!(
        policy(&[stash_foo(), pass(), pop_foo()], &[1, 1, 1]),
        [vec![], vec![], vec![(0, NONE, "foo".to_owned())]]
    );
}

#[test]
fn pop_2_from_different_partitions() {
    // p3 pops 'bar' before 'foo', but the policy is sorted by source partition.
    let decls = [stash_foo(), stash_bar(), pop_bar(), pop_foo()];
    assert_eq!(
        policy(&decls, &[1, 1, 2]),
        [
            vec![],
            vec![],
            vec![(0, NONE, "foo".to_owned()), (1, NONE, "bar".to_owned())]
        ]
    );
}

#[test]
fn namespace() {
    let (ns1, ns2) = (Namespace::new(), Namespace::new());
    let decls = [
        stash_foo().isolate(ns1),
        stash_foo().isolate(ns2),
        pop_foo().isolate(ns2),
        pop_foo().isolate(ns1),
    ];
    assert_eq!(
        policy(&decls, &[1, 1, 2]),
        [
            vec![],
            vec![],
            vec![(0, ns1, "foo".to_owned()), (1, ns2, "foo".to_owned())]
        ]
    );
}

/// Within one source partition, routes are ordered by namespace, then name.
#[test]
fn same_source_orders_by_namespace_then_name() {
    let ns = Namespace::new();
    let decls = [
        Declaration::new()
            .stash(["zeta", "alpha", "mid"])
            .isolate_only(ns, ["alpha"]),
        Declaration::new()
            .pop(["alpha", "mid", "zeta"])
            .isolate_only(ns, ["alpha"]),
    ];
    let got: Vec<_> = policy(&decls, &[1, 1])[1]
        .iter()
        .map(|(_, ns, name)| (*ns, name.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (NONE, "mid".to_owned()),
            (NONE, "zeta".to_owned()),
            (ns, "alpha".to_owned())
        ]
    );
}

/// The U-Net shape split [3, 2, 3]: what moves where, and what stays.
#[test]
fn unet_routes() {
    let ns: Vec<Namespace> = (0..3).map(|_| Namespace::new()).collect();
    let enc = |k: usize| Declaration::new().stash(["skip"]).isolate(ns[k]);
    let dec = |k: usize| Declaration::new().pop(["skip"]).isolate(ns[k]);
    let decls = [
        enc(0),
        enc(1),
        enc(2),
        pass(),
        dec(2),
        dec(1),
        dec(0),
        pass(),
    ];
    let layout = SkipLayout::new(&decls, &[3, 2, 3]).unwrap();

    assert!(layout.copy_policy(0).is_empty());
    let into1: Vec<_> = layout
        .copy_policy(1)
        .iter()
        .map(|r| (r.source, r.ns))
        .collect();
    assert_eq!(into1, [(0, ns[2])]);
    let into2: Vec<_> = layout
        .copy_policy(2)
        .iter()
        .map(|r| (r.source, r.ns))
        .collect();
    assert_eq!(into2, [(0, ns[0]), (0, ns[1])]);
    let r = layout.route(ns[1], "skip").unwrap();
    assert_eq!((r.source, r.dest, r.stash_layer, r.pop_layer), (0, 2, 1, 5));
    assert!(r.requires_copy());
    assert!(layout.requires_copy(ns[2], "skip"));
    assert_eq!(layout.partition_of_pop(ns[2], "skip"), Some(1));
    assert_eq!(layout.routes().count(), 3);
    // Unknown skips never require a copy (torchgpipe's default).
    assert!(!layout.requires_copy(NONE, "skip"));
    assert_eq!(layout.route(NONE, "skip"), None);
    assert_eq!(layout.partition_of_stash(NONE, "skip"), None);

    // One partition: everything local.
    let layout = SkipLayout::new(&decls, &[8]).unwrap();
    assert!(layout.copy_policy(0).is_empty());
    assert_eq!(layout.local(0).len(), 3);
}

#[test]
fn balance_must_cover_the_layers() {
    let decls = [pass(), pass(), pass()];
    let err = SkipLayout::new(&decls, &[1, 1]).unwrap_err();
    assert_eq!(err, Error::BalanceLength { layers: 3, sum: 2 });
    assert_eq!(
        err.to_string(),
        "module and sum of balance have different length (module: 3, sum of balance: 2)"
    );
    let err = SkipLayout::new(&decls, &[3, 0]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "all balance numbers must be positive integer (balance: [3, 0])"
    );
}

/// A layout is only made for a verified sequence: all its problems come back.
#[test]
fn unverified_declarations_are_rejected_with_every_problem() {
    let decls = [pop_foo(), stash_bar()];
    let err = SkipLayout::new(&decls, &[1, 1]).unwrap_err();
    assert!(matches!(
        err.problems(),
        [
            Problem::PopNotStashed { layer: 0, .. },
            Problem::NeverPopped { layer: 1, .. }
        ]
    ));
}
