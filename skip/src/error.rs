//! The crate's one error type and the problems `verify` reports.
//!
//! Messages follow torchgpipe's word for word where it has one (its `verify_skippables`
//! and `Skippable.forward` texts), so its tests port with their expected strings; the
//! run-time ones add the layer index and the namespace.

use std::fmt;

use crate::Namespace;

/// Everything that can go wrong in this crate. Nothing here panics on bad input: a wrong
/// declaration, partitioning or call order is one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// [`verify`](crate::verify) found stashes and pops that do not pair up; every
    /// problem of the sequence is listed, in the order torchgpipe reports them.
    #[error("one or more pairs of stash and pop do not match:\n\n{}", Bullets(.0))]
    Mismatch(Vec<Problem>),

    /// The partition sizes do not add up to the number of layers.
    #[error(
        "module and sum of balance have different length (module: {layers}, sum of balance: {sum})"
    )]
    BalanceLength {
        /// Number of layers (declarations).
        layers: usize,
        /// Sum of the balance.
        sum: usize,
    },

    /// A partition size is zero.
    #[error("all balance numbers must be positive integer (balance: {balance:?})")]
    BalanceNotPositive {
        /// The balance as given.
        balance: Vec<usize>,
    },

    /// A layer stashed a name it did not declare as stashed.
    #[error("layer {layer}: '{name}' in {ns} has not been declared as stashable")]
    NotDeclaredStashable {
        /// Index of the layer.
        layer: usize,
        /// Namespace of the name in that layer's declaration.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A layer popped a name it did not declare as popped.
    #[error("layer {layer}: '{name}' in {ns} has not been declared as poppable")]
    NotDeclaredPoppable {
        /// Index of the layer.
        layer: usize,
        /// Namespace of the name in that layer's declaration.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A layer declares a pop whose value this tracker does not hold when its forward
    /// pass starts (nothing stashed it before, or it was popped already).
    #[error("layer {layer}: '{name}' in {ns} has not been stashed")]
    NotStashed {
        /// Index of the popping layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A layer's forward pass ended without stashing names it declared.
    #[error("layer {layer}: {} must be stashed but have not", Names(.names))]
    MustBeStashed {
        /// Index of the layer.
        layer: usize,
        /// The names not stashed, in declaration order.
        names: Vec<(Namespace, String)>,
    },

    /// A layer's forward pass ended without popping names it declared.
    #[error("layer {layer}: {} must be popped but have not", Names(.names))]
    MustBePopped {
        /// Index of the layer.
        layer: usize,
        /// The names not popped, in declaration order.
        names: Vec<(Namespace, String)>,
    },

    /// A skip was stashed a second time in one micro-batch (twice in one forward pass,
    /// or by a second layer).
    #[error("layer {layer}: '{name}' in {ns} has already been stashed in this micro-batch")]
    StashedTwice {
        /// Index of the layer stashing again.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A layer popped the same name twice in one forward pass.
    #[error("layer {layer}: '{name}' in {ns} has already been popped in this forward pass")]
    PoppedTwice {
        /// Index of the layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// [`Tracker::recompute`](crate::Tracker::recompute) on a tracker made without
    /// checkpointing, which did not keep the values a recomputation needs.
    #[error("layer {layer}: recomputation on a tracker made without checkpointing (use Tracker::with_checkpointing)")]
    NotCheckpointed {
        /// Index of the layer.
        layer: usize,
    },

    /// A recomputation or backward pass for a skip that this layer's forward pass did
    /// not stash or pop in this micro-batch.
    #[error("layer {layer}: the forward pass of this layer did not stash or pop '{name}' in {ns} in this micro-batch")]
    NotForwarded {
        /// Index of the layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A second backward pass of a popping layer in one micro-batch.
    #[error("layer {layer}: the backward pass for '{name}' in {ns} has already run")]
    BackwardTwice {
        /// Index of the layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A gradient handed in for a skip whose stash was nothing (`None`).
    #[error("layer {layer}: '{name}' in {ns} was stashed as nothing, so it has no gradient")]
    GradOfNothing {
        /// Index of the popping layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A popping layer handed in a gradient twice.
    #[error("layer {layer}: the gradient of '{name}' in {ns} has already been handed in")]
    GradTwice {
        /// Index of the popping layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// The stashing layer asked for a gradient before the popping layer's backward pass
    /// ran (or, across partitions, before the gradient was moved back).
    #[error("layer {layer}: the gradient of '{name}' in {ns} has not arrived: the popping layer's backward pass must run first")]
    GradNotReady {
        /// Index of the stashing layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// The stashing layer took a gradient twice.
    #[error("layer {layer}: the gradient of '{name}' in {ns} has already been taken")]
    GradAlreadyTaken {
        /// Index of the stashing layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// A stashing layer's backward pass ended without taking the gradients of values it
    /// stashed: they would be lost.
    #[error("layer {layer}: the gradients of {} must be taken but have not", Names(.names))]
    GradNotTaken {
        /// Index of the stashing layer.
        layer: usize,
        /// The skips whose gradients were not taken, in declaration order.
        names: Vec<(Namespace, String)>,
    },

    /// [`Tracker::take_outgoing`](crate::Tracker::take_outgoing) for a skip this tracker
    /// does not hold as stashed here (never stashed, popped locally, or sent already).
    #[error("no value of '{name}' in {ns} stashed here is waiting to be sent")]
    NothingToSend {
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// [`Tracker::insert_incoming`](crate::Tracker::insert_incoming) for a skip this
    /// tracker already holds or has already consumed.
    #[error("this tracker has already received or stashed '{name}' in {ns}")]
    AlreadyHeld {
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// [`Tracker::take_outgoing_grad`](crate::Tracker::take_outgoing_grad) for a skip
    /// that did not arrive here, whose popping layer's backward pass has not run, or
    /// whose gradient was sent already.
    #[error("no gradient of '{name}' in {ns} received from another partition is waiting to be sent back")]
    NoGradToSend {
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },

    /// [`Tracker::insert_incoming_grad`](crate::Tracker::insert_incoming_grad) for a
    /// skip this tracker did not send, a second time, or with a gradient for a stash of
    /// nothing.
    #[error("unexpected gradient of '{name}' in {ns}: this tracker did not send a value for it, or already received its gradient")]
    UnexpectedGrad {
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },
}

impl Error {
    /// The problems of a [`Error::Mismatch`]; empty for every other error.
    pub fn problems(&self) -> &[Problem] {
        match self {
            Error::Mismatch(problems) => problems,
            _ => &[],
        }
    }
}

/// One broken rule of [`verify`](crate::verify). `layer` is the index of the layer in the
/// sequence, printed as torchgpipe prints an `nn.Sequential` child's name (`'3'`).
///
/// The messages are torchgpipe's; a skip isolated in a namespace adds
/// ` (in namespace #N)`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// One layer declares the same name both as stashed and as popped (rule 1; it compares
    /// names, whatever their namespaces).
    #[error("'{layer}' declared '{name}' both as stashable and as poppable{}", Suffix(*.ns))]
    StashAndPop {
        /// The layer.
        layer: usize,
        /// Namespace of the name in that layer.
        ns: Namespace,
        /// The name.
        name: String,
    },
    /// A second layer stashes a key already stashed (same name, same namespace).
    #[error("'{layer}' redeclared '{name}' as stashable but not isolated by namespace{}", Suffix(*.ns))]
    StashRedeclared {
        /// The second stashing layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },
    /// A second layer pops a key already popped.
    #[error("'{layer}' redeclared '{name}' as poppable but not isolated by namespace{}", Suffix(*.ns))]
    PopRedeclared {
        /// The second popping layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },
    /// A layer pops a key that no earlier layer stashes.
    #[error("'{layer}' declared '{name}' as poppable but it was not stashed{}", Suffix(*.ns))]
    PopNotStashed {
        /// The popping layer.
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },
    /// A stashed key that no later layer pops.
    #[error("no module declared '{name}' as poppable but stashed{}", Suffix(*.ns))]
    NeverPopped {
        /// The stashing layer (not in torchgpipe's message, which has none).
        layer: usize,
        /// Namespace of the skip.
        ns: Namespace,
        /// The name.
        name: String,
    },
}

/// `* problem` lines, torchgpipe's list format.
struct Bullets<'a>(&'a [Problem]);

impl fmt::Display for Bullets<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "* {p}")?;
        }
        Ok(())
    }
}

/// `'a' in the default namespace, 'b' in namespace #2`.
struct Names<'a>(&'a [(Namespace, String)]);

impl fmt::Display for Names<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (ns, name)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "'{name}' in {ns}")?;
        }
        Ok(())
    }
}

/// Nothing for the default namespace, ` (in namespace #N)` otherwise.
struct Suffix(Namespace);

impl fmt::Display for Suffix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_default() {
            Ok(())
        } else {
            write!(f, " (in {})", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_lists_every_problem_as_a_bullet() {
        let ns = Namespace::new();
        let e = Error::Mismatch(vec![
            Problem::StashRedeclared {
                layer: 2,
                ns: Namespace::DEFAULT,
                name: "foo".into(),
            },
            Problem::NeverPopped {
                layer: 0,
                ns,
                name: "bar".into(),
            },
        ]);
        assert_eq!(
            e.to_string(),
            format!(
                "one or more pairs of stash and pop do not match:\n\n\
                 * '2' redeclared 'foo' as stashable but not isolated by namespace\n\
                 * no module declared 'bar' as poppable but stashed (in namespace #{})",
                ns.id()
            )
        );
        assert_eq!(e.problems().len(), 2);
        assert!(Error::NotCheckpointed { layer: 0 }.problems().is_empty());
    }

    #[test]
    fn runtime_messages_name_layer_namespace_and_name() {
        let e = Error::MustBeStashed {
            layer: 4,
            names: vec![
                (Namespace::DEFAULT, "a".into()),
                (Namespace::DEFAULT, "b".into()),
            ],
        };
        assert_eq!(
            e.to_string(),
            "layer 4: 'a' in the default namespace, 'b' in the default namespace \
             must be stashed but have not"
        );
        let e = Error::NotStashed {
            layer: 1,
            ns: Namespace::DEFAULT,
            name: "foo".into(),
        };
        assert_eq!(
            e.to_string(),
            "layer 1: 'foo' in the default namespace has not been stashed"
        );
    }
}
