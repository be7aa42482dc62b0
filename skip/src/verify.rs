//! Static verification of a sequence of declarations: torchgpipe's `verify_skippables`.

use std::collections::BTreeSet;

use crate::{Declaration, Error, Namespace, Problem};

/// Checks that the stashes and pops of a sequence of layers pair up, before any run.
///
/// `decls` are the layers' declarations in order; a layer's index in that order is its
/// name in the messages. Every skip key `(namespace, name)` must be stashed by exactly
/// one layer and popped by exactly one later layer. The rules, in torchgpipe's order,
/// walking the layers front to back:
///
/// 1. a layer may not declare one name both as stashed and as popped
///    ([`Problem::StashAndPop`]; such a name is then left out of rules 2 and 3 for that
///    layer);
/// 2. a key stashed again without a namespace to tell it apart
///    ([`Problem::StashRedeclared`]);
/// 3. a key popped again ([`Problem::PopRedeclared`]), or popped before any layer
///    stashed it ([`Problem::PopNotStashed`]);
/// 4. after the last layer, every key stashed but never popped
///    ([`Problem::NeverPopped`]), in the order they were stashed.
///
/// All problems are reported at once, in one [`Error::Mismatch`].
///
/// ```
/// use skip::{verify, Declaration, Problem};
/// let stash = Declaration::new().stash(["1to3"]);
/// let pop = Declaration::new().pop(["1to3"]);
/// verify(&[stash.clone(), Declaration::new(), pop.clone()]).unwrap();
///
/// // Layer1, Layer1, Layer2, Layer3: the second stash clashes.
/// let err = verify(&[stash.clone(), stash, Declaration::new(), pop]).unwrap_err();
/// assert!(matches!(err.problems(), [Problem::StashRedeclared { layer: 1, .. }]));
/// assert!(err.to_string().contains("'1' redeclared '1to3' as stashable"));
/// ```
pub fn verify<'a, I>(decls: I) -> Result<(), Error>
where
    I: IntoIterator<Item = &'a Declaration>,
{
    let problems = problems(decls);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Mismatch(problems))
    }
}

/// The problems [`verify`] reports, in order; empty when the sequence is valid.
fn problems<'a, I>(decls: I) -> Vec<Problem>
where
    I: IntoIterator<Item = &'a Declaration>,
{
    // Stashed keys with their stashing layer, in stash order (rule 4 reports in it).
    let mut stashed: Vec<(Namespace, &str, usize)> = Vec::new();
    let mut stashed_set: BTreeSet<(Namespace, &str)> = BTreeSet::new();
    let mut popped: BTreeSet<(Namespace, &str)> = BTreeSet::new();
    let mut out = Vec::new();

    for (layer, decl) in decls.into_iter().enumerate() {
        for name in decl.stash_names() {
            if decl.is_poppable(name) {
                out.push(Problem::StashAndPop {
                    layer,
                    ns: decl.namespace(name),
                    name: name.clone(),
                });
            }
        }

        for (ns, name) in decl.stashable() {
            if decl.is_poppable(name) {
                continue;
            }
            if !stashed_set.insert((ns, name)) {
                out.push(Problem::StashRedeclared {
                    layer,
                    ns,
                    name: name.to_owned(),
                });
                continue;
            }
            stashed.push((ns, name, layer));
        }

        for (ns, name) in decl.poppable() {
            if decl.is_stashable(name) {
                continue;
            }
            if popped.contains(&(ns, name)) {
                out.push(Problem::PopRedeclared {
                    layer,
                    ns,
                    name: name.to_owned(),
                });
                continue;
            }
            if !stashed_set.contains(&(ns, name)) {
                out.push(Problem::PopNotStashed {
                    layer,
                    ns,
                    name: name.to_owned(),
                });
                continue;
            }
            popped.insert((ns, name));
        }
    }

    for (ns, name, layer) in stashed {
        if !popped.contains(&(ns, name)) {
            out.push(Problem::NeverPopped {
                layer,
                ns,
                name: name.to_owned(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(names: &[&str]) -> Declaration {
        Declaration::new().stash(names.iter().copied())
    }

    fn p(names: &[&str]) -> Declaration {
        Declaration::new().pop(names.iter().copied())
    }

    #[test]
    fn empty_and_skipless_sequences_are_valid() {
        assert_eq!(verify(&[]), Ok(()));
        assert_eq!(verify(&[Declaration::new(), Declaration::new()]), Ok(()));
    }

    #[test]
    fn problems_come_in_walk_order_then_never_popped() {
        // Layer 0 stashes a and b; 1 pops c (never stashed); 2 pops a twice over (3).
        let decls = [s(&["a", "b"]), p(&["c"]), p(&["a"]), p(&["a"])];
        let got = problems(&decls);
        let d = Namespace::DEFAULT;
        assert_eq!(
            got,
            vec![
                Problem::PopNotStashed {
                    layer: 1,
                    ns: d,
                    name: "c".into()
                },
                Problem::PopRedeclared {
                    layer: 3,
                    ns: d,
                    name: "a".into()
                },
                Problem::NeverPopped {
                    layer: 0,
                    ns: d,
                    name: "b".into()
                },
            ]
        );
    }

    #[test]
    fn same_name_both_ways_is_reported_once_and_skipped_by_the_other_rules() {
        let got = problems(&[Declaration::new().stash(["foo"]).pop(["foo"])]);
        assert_eq!(
            got,
            vec![Problem::StashAndPop {
                layer: 0,
                ns: Namespace::DEFAULT,
                name: "foo".into()
            }]
        );
    }
}
