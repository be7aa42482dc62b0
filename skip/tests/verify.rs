//! torchgpipe's `test_verify_skippables.py`, ported: every rule and message of
//! `verify_skippables`, plus the reporting of several problems at once.

use skip::{verify, Declaration, Error, Namespace, Problem};

fn stash(names: &[&str]) -> Declaration {
    Declaration::new().stash(names.iter().copied())
}

fn pop(names: &[&str]) -> Declaration {
    Declaration::new().pop(names.iter().copied())
}

/// The error's message, which must be a mismatch.
fn message(decls: &[Declaration]) -> String {
    match verify(decls) {
        Err(e @ Error::Mismatch(_)) => e.to_string(),
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn matching() {
    assert_eq!(verify(&[stash(&["foo"]), pop(&["foo"])]), Ok(()));
}

#[test]
fn stash_not_pop() {
    let m = message(&[stash(&["foo"])]);
    assert!(
        m.contains("no module declared 'foo' as poppable but stashed"),
        "{m}"
    );
}

#[test]
fn pop_unknown() {
    let m = message(&[pop(&["foo"])]);
    assert!(
        m.contains("'0' declared 'foo' as poppable but it was not stashed"),
        "{m}"
    );
}

#[test]
fn stash_again() {
    let m = message(&[stash(&["foo"]), stash(&["foo"]), pop(&["foo"])]);
    assert!(m.contains("'1' redeclared 'foo' as stashable"), "{m}");
    assert!(m.contains("but not isolated by namespace"), "{m}");
}

#[test]
fn pop_again() {
    let m = message(&[stash(&["foo"]), pop(&["foo"]), pop(&["foo"])]);
    assert!(m.contains("'2' redeclared 'foo' as poppable"), "{m}");
}

#[test]
fn stash_pop_together_different_names() {
    let decls = [
        stash(&["foo"]),
        Declaration::new().pop(["foo"]).stash(["bar"]),
        pop(&["bar"]),
    ];
    assert_eq!(verify(&decls), Ok(()));
}

#[test]
fn stash_pop_together_same_name() {
    let m = message(&[Declaration::new().stash(["foo"]).pop(["foo"])]);
    assert!(
        m.contains("'0' declared 'foo' both as stashable and as poppable"),
        "{m}"
    );
}

#[test]
fn double_stash_pop() {
    let decls = [
        stash(&["foo"]),
        pop(&["foo"]),
        stash(&["foo"]),
        pop(&["foo"]),
    ];
    let m = message(&decls);
    assert!(m.contains("'2' redeclared 'foo' as stashable"), "{m}");
    assert!(m.contains("'3' redeclared 'foo' as poppable"), "{m}");
}

#[test]
fn double_stash_pop_but_isolated() {
    let (ns1, ns2) = (Namespace::new(), Namespace::new());
    let decls = [
        stash(&["foo"]).isolate(ns1),
        pop(&["foo"]).isolate(ns1),
        stash(&["foo"]).isolate(ns2),
        pop(&["foo"]).isolate(ns2),
    ];
    assert_eq!(verify(&decls), Ok(()));
}

/// The whole message, in torchgpipe's format: a header, a blank line, one bullet per
/// problem in walk order, never-popped stashes last.
#[test]
fn every_problem_is_reported_at_once_in_order() {
    let decls = [
        stash(&["a", "b"]),                         // 0
        Declaration::new().stash(["x"]).pop(["x"]), // 1: rule 1
        stash(&["a"]),                              // 2: a again
        pop(&["c"]),                                // 3: c never stashed
        pop(&["a"]),                                // 4
        pop(&["a"]),                                // 5: a popped again
    ];
    assert_eq!(
        message(&decls),
        "one or more pairs of stash and pop do not match:\n\n\
         * '1' declared 'x' both as stashable and as poppable\n\
         * '2' redeclared 'a' as stashable but not isolated by namespace\n\
         * '3' declared 'c' as poppable but it was not stashed\n\
         * '5' redeclared 'a' as poppable but not isolated by namespace\n\
         * no module declared 'b' as poppable but stashed"
    );
    let err = verify(&decls).unwrap_err();
    assert_eq!(err.problems().len(), 5);
    assert_eq!(
        err.problems()[4],
        Problem::NeverPopped {
            layer: 0,
            ns: Namespace::DEFAULT,
            name: "b".into()
        }
    );
}

/// Rule 1 compares names, not keys: popping 'skip' from one namespace and stashing 'skip'
/// into another on one layer is still rejected, as in torchgpipe.
#[test]
fn same_name_in_two_namespaces_on_one_layer_is_rejected() {
    let (ns1, ns2) = (Namespace::new(), Namespace::new());
    let decls = [
        stash(&["skip"]).isolate(ns1),
        Declaration::new()
            .pop(["skip"])
            .isolate(ns1)
            .stash(["skip"])
            .isolate_only(ns2, ["skip"]),
        pop(&["skip"]).isolate(ns2),
    ];
    let err = verify(&decls).unwrap_err();
    assert!(matches!(
        err.problems()[0],
        Problem::StashAndPop { layer: 1, .. }
    ));
}

/// Isolated keys say which namespace they are in; the reference text stays a prefix.
#[test]
fn isolated_keys_name_their_namespace() {
    let ns = Namespace::new();
    let m = message(&[stash(&["foo"]).isolate(ns)]);
    assert!(m.ends_with(&format!(
        "* no module declared 'foo' as poppable but stashed (in namespace #{})",
        ns.id()
    )));
}

/// `isolate_only` separates one name of a block that is used twice, and only that name.
#[test]
fn isolate_only_one_name() {
    let (a, b) = (Namespace::new(), Namespace::new());
    let stash_stash_pop = |ns| {
        Declaration::new()
            .stash(["alice", "bob"])
            .pop(["carol"])
            .isolate_only(ns, ["alice"])
    };
    let decls = [
        stash(&["carol"]),
        stash_stash_pop(a),
        pop(&["alice"]).isolate(a),
        stash(&["carol"]),
        stash_stash_pop(b),
        pop(&["alice", "bob"]).isolate_only(b, ["alice"]),
    ];
    // 'alice' is isolated each time and pairs up; 'bob' and 'carol' stay in the default
    // namespace, so the block's second use stashes 'bob' and pops 'carol' again, and the
    // second stash of 'carol' clashes too.
    let err = verify(&decls).unwrap_err();
    assert_eq!(
        err.problems(),
        [
            Problem::StashRedeclared {
                layer: 3,
                ns: Namespace::DEFAULT,
                name: "carol".into()
            },
            Problem::StashRedeclared {
                layer: 4,
                ns: Namespace::DEFAULT,
                name: "bob".into()
            },
            Problem::PopRedeclared {
                layer: 4,
                ns: Namespace::DEFAULT,
                name: "carol".into()
            },
        ]
    );
}
