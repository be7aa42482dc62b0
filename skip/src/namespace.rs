//! Namespaces: the first half of every skip key `(namespace, name)`.
//!
//! One block type declares one set of names; placing it several times in a model (U-Net's
//! encoder/decoder pairs) would make the names clash. Isolating each instance into its own
//! [`Namespace`] keeps the keys apart while the code of the block stays the same.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// The id the next [`Namespace::new`] hands out; 0 is the default namespace.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A namespace isolating skip names: two skips with the same name in different
/// namespaces are different skips.
///
/// torchgpipe uses a random UUID; here each [`Namespace::new`] takes the next number of a
/// process-wide counter, so namespaces are unique within the process and their order (the
/// order of a layout's copy policy) is the order in which they were created.
/// [`Namespace::DEFAULT`] (torchgpipe's `None`) is where every name lives until it is
/// isolated; it orders before every other namespace.
///
/// Note that [`Namespace::default()`] is that default namespace, while
/// [`Namespace::new()`] is a fresh one.
///
/// ```
/// use skip::Namespace;
/// let (a, b) = (Namespace::new(), Namespace::new());
/// assert_ne!(a, b);
/// assert!(a < b && Namespace::DEFAULT < a);
/// assert_eq!(Namespace::default(), Namespace::DEFAULT);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Namespace(u64);

impl Namespace {
    /// The namespace of every name that was not isolated (torchgpipe's `None`).
    pub const DEFAULT: Namespace = Namespace(0);

    /// A fresh namespace, different from every other one in this process.
    pub fn new() -> Self {
        Namespace(NEXT_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// The namespace numbered `id` (what [`id`](Namespace::id) returns): how a
    /// declaration that crossed to another process names its namespaces there (a pipe's
    /// stages on ranks exchange their declarations when the pipe is built). Within one
    /// process, use [`Namespace::new`]: a number taken from here is not reserved.
    pub fn from_id(id: u64) -> Self {
        Namespace(id)
    }

    /// Whether this is [`Namespace::DEFAULT`].
    pub fn is_default(self) -> bool {
        self == Self::DEFAULT
    }

    /// The namespace's number: 0 for the default namespace, then in order of creation.
    pub fn id(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Namespace {
    /// `the default namespace` or `namespace #N`, as error messages print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_default() {
            f.write_str("the default namespace")
        } else {
            write!(f, "namespace #{}", self.0)
        }
    }
}

/// A map keyed by `(namespace, name)` that looks names up as `&str`, without building an
/// owned key, and iterates in key order.
#[derive(Debug, Clone)]
pub(crate) struct KeyMap<V> {
    map: BTreeMap<Namespace, BTreeMap<String, V>>,
}

impl<V> Default for KeyMap<V> {
    fn default() -> Self {
        KeyMap {
            map: BTreeMap::new(),
        }
    }
}

impl<V> KeyMap<V> {
    pub(crate) fn get(&self, ns: Namespace, name: &str) -> Option<&V> {
        self.map.get(&ns)?.get(name)
    }

    pub(crate) fn get_mut(&mut self, ns: Namespace, name: &str) -> Option<&mut V> {
        self.map.get_mut(&ns)?.get_mut(name)
    }

    pub(crate) fn contains(&self, ns: Namespace, name: &str) -> bool {
        self.get(ns, name).is_some()
    }

    /// Inserts, returning the value it replaced.
    pub(crate) fn insert(&mut self, ns: Namespace, name: &str, value: V) -> Option<V> {
        self.map
            .entry(ns)
            .or_default()
            .insert(name.to_owned(), value)
    }

    pub(crate) fn remove(&mut self, ns: Namespace, name: &str) -> Option<V> {
        let inner = self.map.get_mut(&ns)?;
        let value = inner.remove(name);
        if inner.is_empty() {
            self.map.remove(&ns);
        }
        value
    }

    pub(crate) fn is_empty(&self) -> bool {
        // `remove` prunes empty inner maps, so an empty outer map means no entries.
        self.map.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.values().map(BTreeMap::len).sum()
    }

    /// Every key and value, in `(namespace, name)` order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Namespace, &str, &V)> + '_ {
        self.map
            .iter()
            .flat_map(|(&ns, inner)| inner.iter().map(move |(k, v)| (ns, k.as_str(), v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_distinct_ordered_and_copyable() {
        let a = Namespace::new();
        let b = Namespace::new();
        assert_ne!(a, b);
        assert!(a < b);
        let c = a; // torchgpipe's test_namespace_copy: a copy equals the original
        assert_eq!(c, a);
        assert!(!a.is_default() && Namespace::DEFAULT.is_default());
        assert!(Namespace::DEFAULT < a);
        assert_eq!(Namespace::DEFAULT.to_string(), "the default namespace");
        assert_eq!(a.to_string(), format!("namespace #{}", a.id()));
    }

    #[test]
    fn keymap_separates_namespaces_and_prunes() {
        let ns = Namespace::new();
        let mut m = KeyMap::default();
        assert!(m.insert(Namespace::DEFAULT, "foo", 1).is_none());
        assert!(m.insert(ns, "foo", 2).is_none());
        assert_eq!(m.insert(ns, "foo", 3), Some(2));
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(Namespace::DEFAULT, "foo"), Some(&1));
        assert_eq!(m.get(ns, "foo"), Some(&3));
        assert!(m.get(ns, "bar").is_none());
        *m.get_mut(ns, "foo").unwrap() += 1;
        let keys: Vec<_> = m.iter().map(|(n, k, v)| (n, k.to_owned(), *v)).collect();
        assert_eq!(
            keys,
            vec![(Namespace::DEFAULT, "foo".into(), 1), (ns, "foo".into(), 4)]
        );
        assert_eq!(m.remove(Namespace::DEFAULT, "foo"), Some(1));
        assert_eq!(m.remove(Namespace::DEFAULT, "foo"), None);
        assert!(!m.is_empty());
        assert!(m.contains(ns, "foo"));
        assert_eq!(m.remove(ns, "foo"), Some(4));
        assert!(m.is_empty());
        assert_eq!(m.len(), 0);
    }
}
