//! A residual block through skips: [`StashInput`] opens it, [`AddSkip`] closes it, and
//! the layers in between may sit on other partitions, which never see the skipped value.

use skip::{Declaration, Namespace};

use crate::error::Error;
use crate::layer::{Context, Layer, Saved};
use crate::microbatch::Batch;
use crate::tensor::Tensor;

/// Passes its input on unchanged and stashes a copy under `name`: the start of a residual
/// block (torchgpipe's `yield stash(name, input)`).
///
/// Backward: the output gradient plus the gradient [`AddSkip`] handed in for the stash.
/// Any tensor type; a single chunked tensor in and out.
#[derive(Debug, Clone)]
pub struct StashInput {
    name: String,
    decl: Declaration,
}

impl StashInput {
    /// Stashes under `name` in the default namespace.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        let decl = Declaration::new().stash([name.clone()]);
        StashInput { name, decl }
    }

    /// The same, with `name` isolated in `ns`, so the block can repeat in one model.
    #[must_use]
    pub fn isolate(mut self, ns: Namespace) -> Self {
        self.decl = self.decl.isolate(ns);
        self
    }
}

impl<T: Tensor> Layer<T> for StashInput {
    fn forward(
        &mut self,
        input: Batch<T>,
        ctx: &mut Context,
    ) -> Result<(Batch<T>, Saved<T>), Error> {
        let x = input.into_single()?;
        let skips = ctx.skips::<T>()?;
        skips.stash(&self.name, x.clone())?;
        skips.finish()?;
        Ok((Batch::single(x), Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<T>,
        _saved: Saved<T>,
        ctx: &mut Context,
    ) -> Result<Batch<T>, Error> {
        let mut dy = grad_output.into_single()?;
        let mut grads = ctx.skip_grads::<T>()?;
        if let Some(g) = grads.take_grad(&self.name)? {
            dy.accumulate(&g)?;
        }
        grads.finish()?;
        Ok(Batch::single(dy))
    }

    fn skips(&self) -> Declaration {
        self.decl.clone()
    }
}

/// Pops the value stashed under `name` and adds it to its input: the end of a residual
/// block (`y = x + skip`; a stash of nothing adds nothing).
///
/// Backward: the output gradient goes both to the input and, handed in through the
/// tracker, to the stash. Any tensor type; a single chunked tensor in and out.
#[derive(Debug, Clone)]
pub struct AddSkip {
    name: String,
    decl: Declaration,
}

impl AddSkip {
    /// Pops `name` from the default namespace.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        let decl = Declaration::new().pop([name.clone()]);
        AddSkip { name, decl }
    }

    /// The same, with `name` isolated in `ns` (the namespace of the matching
    /// [`StashInput`]).
    #[must_use]
    pub fn isolate(mut self, ns: Namespace) -> Self {
        self.decl = self.decl.isolate(ns);
        self
    }
}

impl<T: Tensor> Layer<T> for AddSkip {
    fn forward(
        &mut self,
        input: Batch<T>,
        ctx: &mut Context,
    ) -> Result<(Batch<T>, Saved<T>), Error> {
        let mut x = input.into_single()?;
        let skips = ctx.skips::<T>()?;
        if let Some(skip) = skips.pop(&self.name)? {
            x.accumulate(skip)?;
        }
        skips.finish()?;
        Ok((Batch::single(x), Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<T>,
        _saved: Saved<T>,
        ctx: &mut Context,
    ) -> Result<Batch<T>, Error> {
        let dy = grad_output.into_single()?;
        let mut grads = ctx.skip_grads::<T>()?;
        match grads.put_grad(&self.name, dy.clone()) {
            // The stashing layer stashed nothing: no gradient flows back to it.
            Err(skip::Error::GradOfNothing { .. }) | Ok(()) => {}
            Err(e) => return Err(e.into()),
        }
        grads.finish()?;
        Ok(Batch::single(dy))
    }

    fn skips(&self) -> Declaration {
        self.decl.clone()
    }
}

/// A residual block, `x + inner(x)`, as layers for a pipe: [`StashInput`], the `inner`
/// layers, [`AddSkip`], the skip isolated in a fresh namespace so blocks can repeat. The
/// pipe may cut the block anywhere; the skip then moves straight from the partition of
/// its first layer to the partition of its last.
pub fn residual<T: Tensor>(inner: Vec<Box<dyn Layer<T>>>) -> Vec<Box<dyn Layer<T>>> {
    let ns = Namespace::new();
    let mut layers: Vec<Box<dyn Layer<T>>> = Vec::with_capacity(inner.len() + 2);
    layers.push(Box::new(StashInput::new("residual").isolate(ns)));
    layers.extend(inner);
    layers.push(Box::new(AddSkip::new("residual").isolate(ns)));
    layers
}
