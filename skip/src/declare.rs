//! Declarations: the names a layer stashes and pops, fixed before any run.

use std::collections::BTreeMap;

use crate::Namespace;

/// What one layer stashes and pops: torchgpipe's `@skippable(stash=[...], pop=[...])`,
/// plus the namespaces its names are isolated into (`isolate`).
///
/// A layer with skips owns one `Declaration` and shows it to [`verify`](crate::verify),
/// to [`SkipLayout::new`](crate::SkipLayout::new) and to the tracker at every pass; a
/// layer without skips has the empty one, [`Declaration::new()`]. Names are kept in the
/// order first declared, once each (torchgpipe keeps sets).
///
/// ```
/// use skip::{Declaration, Namespace};
/// let (alice_ns, bob_ns) = (Namespace::new(), Namespace::new());
/// let decl = Declaration::new()
///     .stash(["alice", "bob"])
///     .pop(["carol"])
///     .isolate_only(alice_ns, ["alice"])
///     .isolate_only(bob_ns, ["bob"]);
/// assert_eq!(decl.namespace("alice"), alice_ns);
/// assert_eq!(decl.namespace("carol"), Namespace::DEFAULT);
/// assert!(decl.is_stashable("bob") && decl.is_poppable("carol"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Declaration {
    stash: Vec<String>,
    pop: Vec<String>,
    namespaces: BTreeMap<String, Namespace>,
}

fn add_names<I>(list: &mut Vec<String>, names: I)
where
    I: IntoIterator,
    I::Item: Into<String>,
{
    for name in names {
        let name = name.into();
        if !list.contains(&name) {
            list.push(name);
        }
    }
}

impl Declaration {
    /// A declaration of nothing: the layer neither stashes nor pops.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds names this layer stashes (a name already declared is kept once).
    #[must_use]
    pub fn stash<I>(mut self, names: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        add_names(&mut self.stash, names);
        self
    }

    /// Adds names this layer pops (a name already declared is kept once).
    #[must_use]
    pub fn pop<I>(mut self, names: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        add_names(&mut self.pop, names);
        self
    }

    /// Isolates every name declared so far (stashed or popped) into `ns`.
    ///
    /// Names added afterwards stay where they are: call it last.
    #[must_use]
    pub fn isolate(mut self, ns: Namespace) -> Self {
        for name in self.stash.iter().chain(&self.pop) {
            self.namespaces.insert(name.clone(), ns);
        }
        self
    }

    /// Isolates only the names in `only` into `ns`, so calls chain:
    /// `.isolate_only(ns_a, ["alice"]).isolate_only(ns_b, ["bob"])`.
    ///
    /// As in torchgpipe, a name in `only` need not be declared yet.
    #[must_use]
    pub fn isolate_only<I>(mut self, ns: Namespace, only: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        for name in only {
            self.namespaces.insert(name.into(), ns);
        }
        self
    }

    /// The namespace `name` lives in: where it was isolated, else the default one.
    pub fn namespace(&self, name: &str) -> Namespace {
        self.namespaces
            .get(name)
            .copied()
            .unwrap_or(Namespace::DEFAULT)
    }

    /// The names this layer stashes, in declaration order.
    pub fn stash_names(&self) -> &[String] {
        &self.stash
    }

    /// The names this layer pops, in declaration order.
    pub fn pop_names(&self) -> &[String] {
        &self.pop
    }

    /// Whether `name` is declared as stashed by this layer.
    pub fn is_stashable(&self, name: &str) -> bool {
        self.stash.iter().any(|n| n == name)
    }

    /// Whether `name` is declared as popped by this layer.
    pub fn is_poppable(&self, name: &str) -> bool {
        self.pop.iter().any(|n| n == name)
    }

    /// The stashed skips as `(namespace, name)` keys, in declaration order.
    pub fn stashable(&self) -> impl Iterator<Item = (Namespace, &str)> + '_ {
        self.stash.iter().map(|n| (self.namespace(n), n.as_str()))
    }

    /// The popped skips as `(namespace, name)` keys, in declaration order.
    pub fn poppable(&self) -> impl Iterator<Item = (Namespace, &str)> + '_ {
        self.pop.iter().map(|n| (self.namespace(n), n.as_str()))
    }

    /// Whether the layer declares no skip at all.
    pub fn is_empty(&self) -> bool {
        self.stash.is_empty() && self.pop.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_kept_once_in_order() {
        let d = Declaration::new().stash(["b", "a", "b"]).stash(["a", "c"]);
        assert_eq!(d.stash_names(), ["b", "a", "c"]);
        assert!(d.pop_names().is_empty());
        assert!(!d.is_empty());
        assert!(Declaration::new().is_empty());
    }

    #[test]
    fn isolate_covers_names_declared_so_far() {
        let ns = Namespace::new();
        let d = Declaration::new()
            .stash(["x"])
            .pop(["y"])
            .isolate(ns)
            .stash(["z"]);
        assert_eq!(d.namespace("x"), ns);
        assert_eq!(d.namespace("y"), ns);
        assert_eq!(d.namespace("z"), Namespace::DEFAULT);
        let keys: Vec<_> = d.stashable().collect();
        assert_eq!(keys, [(ns, "x"), (Namespace::DEFAULT, "z")]);
        assert_eq!(d.poppable().collect::<Vec<_>>(), [(ns, "y")]);
    }

    #[test]
    fn isolate_only_chains_and_later_calls_win() {
        let (a, b) = (Namespace::new(), Namespace::new());
        let d = Declaration::new()
            .stash(["alice", "bob"])
            .pop(["carol"])
            .isolate_only(a, ["alice"])
            .isolate_only(b, ["bob"]);
        assert_eq!(
            (d.namespace("alice"), d.namespace("bob")),
            (a, b),
            "each name in its own namespace"
        );
        assert_eq!(d.namespace("carol"), Namespace::DEFAULT);
        let d = d.isolate(b);
        assert_eq!(d.namespace("alice"), b);
        assert_eq!(d.namespace("carol"), b);
    }
}
