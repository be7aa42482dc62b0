//! Where each skip goes once the layers are split into partitions: torchgpipe's
//! `SkipLayout` and `inspect_skip_layout`.

use std::ops::Range;

use crate::namespace::KeyMap;
use crate::{verify, Declaration, Error, Namespace};

/// One skip's way through a partitioned sequence: stashed by `stash_layer` in partition
/// `source`, popped by `pop_layer` in partition `dest`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Partition of the stashing layer.
    pub source: usize,
    /// Partition of the popping layer.
    pub dest: usize,
    /// Namespace of the skip.
    pub ns: Namespace,
    /// Name of the skip.
    pub name: String,
    /// Global index of the stashing layer.
    pub stash_layer: usize,
    /// Global index of the popping layer.
    pub pop_layer: usize,
}

impl Route {
    /// Whether the value must move between partitions (`source != dest`).
    pub fn requires_copy(&self) -> bool {
        self.source != self.dest
    }
}

/// The skip routes of a verified sequence of declarations split by a `balance`.
///
/// A pipeline engine moves each skip once, straight from the stashing partition to the
/// popping one: for micro-batch `i`, before partition `j` runs, every route of
/// [`copy_policy(j)`](SkipLayout::copy_policy) moves its value from the tracker of
/// `(i, route.source)` to the tracker of `(i, j)`
/// ([`Tracker::take_outgoing`](crate::Tracker::take_outgoing) then
/// [`Tracker::insert_incoming`](crate::Tracker::insert_incoming)); after partition `j`'s
/// backward pass the same routes carry the gradients back
/// ([`Tracker::take_outgoing_grad`](crate::Tracker::take_outgoing_grad),
/// [`Tracker::insert_incoming_grad`](crate::Tracker::insert_incoming_grad)). Partitions in
/// between never see the value. Routes whose two ends share a partition stay in its
/// tracker ([`local`](SkipLayout::local)).
///
/// ```
/// use skip::{Declaration, SkipLayout};
/// let decls = [
///     Declaration::new().stash(["foo"]),
///     Declaration::new(),
///     Declaration::new().pop(["foo"]),
/// ];
/// let layout = SkipLayout::new(&decls, &[1, 1, 1])?;
/// assert!(layout.copy_policy(1).is_empty());
/// let r = &layout.copy_policy(2)[0];
/// assert_eq!((r.source, r.name.as_str()), (0, "foo"));
/// # Ok::<(), skip::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct SkipLayout {
    bounds: Vec<usize>,
    by_key: KeyMap<Route>,
    copies: Vec<Vec<Route>>,
    local: Vec<Vec<Route>>,
}

impl SkipLayout {
    /// Verifies `decls` (as [`verify`](crate::verify), with all its problems) and the
    /// `balance` (layers per partition: each positive, adding up to the number of
    /// layers, torchgpipe's messages), then routes every skip.
    pub fn new<'a, I>(decls: I, balance: &[usize]) -> Result<Self, Error>
    where
        I: IntoIterator<Item = &'a Declaration>,
    {
        let decls: Vec<&Declaration> = decls.into_iter().collect();
        let sum: usize = balance.iter().sum();
        if sum != decls.len() {
            return Err(Error::BalanceLength {
                layers: decls.len(),
                sum,
            });
        }
        if balance.contains(&0) {
            return Err(Error::BalanceNotPositive {
                balance: balance.to_vec(),
            });
        }
        verify(decls.iter().copied())?;

        // bounds[j]..bounds[j + 1] are the layers of partition j.
        let mut bounds = vec![0];
        bounds.extend(balance.iter().scan(0, |acc, &n| {
            *acc += n;
            Some(*acc)
        }));

        let mut stashed_at: KeyMap<(usize, usize)> = KeyMap::default();
        let mut by_key: KeyMap<Route> = KeyMap::default();
        let partitions = (balance.iter().enumerate()).flat_map(|(j, &n)| std::iter::repeat_n(j, n));
        for ((layer, decl), j) in decls.iter().enumerate().zip(partitions) {
            for (ns, name) in decl.stashable() {
                stashed_at.insert(ns, name, (j, layer));
            }
            for (ns, name) in decl.poppable() {
                // Verified: every pop has exactly one earlier stash.
                if let Some((source, stash_layer)) = stashed_at.remove(ns, name) {
                    let route = Route {
                        source,
                        dest: j,
                        ns,
                        name: name.to_owned(),
                        stash_layer,
                        pop_layer: layer,
                    };
                    by_key.insert(ns, name, route);
                }
            }
        }

        let mut copies = vec![Vec::new(); balance.len()];
        let mut local = vec![Vec::new(); balance.len()];
        for (_, _, route) in by_key.iter() {
            let list = if route.requires_copy() {
                &mut copies[route.dest]
            } else {
                &mut local[route.dest]
            };
            list.push(route.clone());
        }
        for list in copies.iter_mut().chain(local.iter_mut()) {
            list.sort_by(|a, b| (a.source, a.ns, &a.name).cmp(&(b.source, b.ns, &b.name)));
        }

        Ok(SkipLayout {
            bounds,
            by_key,
            copies,
            local,
        })
    }

    /// Number of partitions.
    pub fn num_partitions(&self) -> usize {
        self.bounds.len() - 1
    }

    /// The global layer indices of partition `j` (empty if there is no such partition).
    pub fn layers(&self, j: usize) -> Range<usize> {
        match (self.bounds.get(j), self.bounds.get(j + 1)) {
            (Some(&start), Some(&end)) => start..end,
            _ => 0..0,
        }
    }

    /// The partition holding global layer `layer`, if any.
    pub fn partition_of_layer(&self, layer: usize) -> Option<usize> {
        (0..self.num_partitions()).find(|&j| self.layers(j).contains(&layer))
    }

    /// The skips partition `j` must receive before it runs, as routes from their source
    /// partition, sorted by source partition, then namespace, then name (torchgpipe's
    /// `copy_policy`, whatever the order of the pops). Routes that stay inside `j` are
    /// left out; an unknown partition has none.
    pub fn copy_policy(&self, j: usize) -> &[Route] {
        self.copies.get(j).map_or(&[], Vec::as_slice)
    }

    /// The skips stashed and popped inside partition `j`, in the same order: they never
    /// leave its tracker.
    pub fn local(&self, j: usize) -> &[Route] {
        self.local.get(j).map_or(&[], Vec::as_slice)
    }

    /// Whether the skip must move between partitions; false for an unknown skip, as in
    /// torchgpipe.
    pub fn requires_copy(&self, ns: Namespace, name: &str) -> bool {
        self.route(ns, name).is_some_and(Route::requires_copy)
    }

    /// The route of one skip.
    pub fn route(&self, ns: Namespace, name: &str) -> Option<&Route> {
        self.by_key.get(ns, name)
    }

    /// The partition whose layer stashes the skip.
    pub fn partition_of_stash(&self, ns: Namespace, name: &str) -> Option<usize> {
        self.route(ns, name).map(|r| r.source)
    }

    /// The partition whose layer pops the skip.
    pub fn partition_of_pop(&self, ns: Namespace, name: &str) -> Option<usize> {
        self.route(ns, name).map(|r| r.dest)
    }

    /// Every route, in `(namespace, name)` order.
    pub fn routes(&self) -> impl Iterator<Item = &Route> + '_ {
        self.by_key.iter().map(|(_, _, r)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cover_the_layers() {
        let decls = vec![Declaration::new(); 9];
        let layout = SkipLayout::new(&decls, &[3, 2, 4]).unwrap();
        assert_eq!(layout.num_partitions(), 3);
        assert_eq!(
            (layout.layers(0), layout.layers(1), layout.layers(2)),
            (0..3, 3..5, 5..9)
        );
        assert_eq!(layout.layers(3), 0..0);
        assert_eq!(layout.partition_of_layer(4), Some(1));
        assert_eq!(layout.partition_of_layer(8), Some(2));
        assert_eq!(layout.partition_of_layer(9), None);
        assert!(layout.copy_policy(7).is_empty());
        assert_eq!(layout.routes().count(), 0);
    }

    #[test]
    fn empty_sequence_with_empty_balance_is_legal() {
        let layout = SkipLayout::new(&[], &[]).unwrap();
        assert_eq!(layout.num_partitions(), 0);
        assert_eq!(layout.partition_of_layer(0), None);
    }
}
