//! [`CudaTensor`]: an `f32` n-d array in device memory, used on one stream.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaEvent, CudaSlice, PushKernelArg};

use super::device::{driver, Gpu, GpuStream};
use crate::cpu::CpuTensor;
use crate::error::Error;
use crate::tensor::Tensor;
use crate::vocab::Device;

/// Device memory, the stream it lives on (its home: allocated, written and freed there),
/// and the other streams that have read it.
struct Buffer {
    /// `None` only while being moved to another stream.
    slice: Option<CudaSlice<f32>>,
    home: Arc<GpuStream>,
    /// Streams other than `home` that have read the memory (registered by
    /// [`CudaTensor::on`] and the cross-stream reads); the home waits for each before it
    /// frees or overwrites the memory.
    readers: Mutex<Vec<Arc<GpuStream>>>,
}

impl Buffer {
    fn new(slice: CudaSlice<f32>, home: Arc<GpuStream>) -> Self {
        home.count(slice.len() * 4);
        Buffer {
            slice: Some(slice),
            home,
            readers: Mutex::new(Vec::new()),
        }
    }

    fn slice(&self) -> &CudaSlice<f32> {
        self.slice
            .as_ref()
            .expect("a buffer's slice is present outside a move")
    }

    fn readers(&self) -> MutexGuard<'_, Vec<Arc<GpuStream>>> {
        self.readers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `stream` reads the memory (it has waited for the home's writes).
    fn read_on(&self, stream: &Arc<GpuStream>) {
        if Arc::ptr_eq(stream, &self.home) {
            return;
        }
        let mut readers = self.readers();
        if !readers.iter().any(|r| Arc::ptr_eq(r, stream)) {
            readers.push(stream.clone());
        }
    }

    /// Makes `stream` wait for every read enqueued so far on the readers, and forgets
    /// them: work enqueued on `stream` afterwards may overwrite or free the memory. On an
    /// error the readers are kept and the caller must not reuse the memory.
    fn wait_for_readers(&self, stream: &GpuStream) -> Result<(), Error> {
        let mut readers = self.readers();
        for r in readers.iter() {
            stream.wait_for(r)?;
        }
        readers.clear();
        Ok(())
    }

    /// Takes the memory out to move it to `stream`, which waits here for the home (its
    /// writes, and reads by holders since gone) and for every reader; the home stops
    /// counting it.
    fn take_for(&mut self, stream: &GpuStream) -> Result<CudaSlice<f32>, Error> {
        // The home's whole queue, not a handle's ready event: reads enqueued on the home
        // after a hand-over (the producer's backward reading its saved output, say) are
        // ordered only by this wait.
        stream.wait_for(&self.home)?;
        self.wait_for_readers(stream)?;
        let slice = self.slice.take().expect("present outside a move");
        self.home.uncount(slice.len() * 4);
        Ok(slice)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let Some(slice) = self.slice.take() else {
            return;
        };
        let readers = std::mem::take(&mut *self.readers());
        if readers.is_empty() {
            // Only the home used it: freed there, after its uses (stream-ordered).
            self.home.uncount(slice.len() * 4);
            let _ = self.home.gpu().context().bind_to_thread();
            drop(slice);
            return;
        }
        // Every read on another stream was enqueued while a holder was alive, so before
        // this drop: an event recorded on each reader now follows its reads, and the
        // memory is freed once all have completed (no stream waits for another). Where an
        // event cannot be recorded the reader is waited for on the host; where that fails
        // too the memory is leaked rather than freed under a reader.
        let mut events = Vec::with_capacity(readers.len());
        for r in &readers {
            match r.event() {
                Ok(e) => events.push(e),
                Err(_) if r.synchronize().is_ok() => {}
                Err(_) => {
                    std::mem::forget(slice);
                    return;
                }
            }
        }
        let gpu = self.home.gpu().clone();
        gpu.bury(slice, self.home.clone(), events);
    }
}

/// A dense row-major `f32` array on a CUDA device; the first axis is the batch dimension.
///
/// # Ordering
///
/// A tensor is used on one [`GpuStream`], its [`home`](CudaTensor::home): every kernel,
/// copy and product that touches it is enqueued there, so within a partition (one stream)
/// the order is the stream's own and nothing waits on the host.
///
/// When a tensor reaches a layer on another stream of the same device (the next
/// partition), the layer calls [`on`](CudaTensor::on): the new stream waits on the
/// tensor's ready event, recorded on the producer's stream right after the producer's
/// work when the pipe handed the tensor over ([`Tensor::to_device`]), or else on an event
/// recorded after everything enqueued there so far; and the new stream is recorded as a
/// reader of the memory. Nothing is copied. The memory stays where it was allocated until
/// a write: a write through a tensor whose memory is shared copies it first (copy on
/// write, so clones never see each other's changes and nothing is written while another
/// stream may read), and a write through the sole holder on another stream moves the
/// memory there, that stream first waiting for the old one and every reader. When the last
/// holder goes, memory read by other streams is freed only after an event recorded then
/// on every reader has completed (as PyTorch's caching allocator treats `record_stream`):
/// no stream waits on another to free it. None of this relies on cudarc's per-slice event
/// tracking, which [`Gpu`] turns off.
///
/// What is yours: work you enqueue yourself on a tensor's memory (through
/// [`slice`](CudaTensor::slice) and [`slice_mut`](CudaTensor::slice_mut)) goes on its
/// home stream, or is ordered with it by events of your own.
///
/// [`Tensor::size_bytes`] counts the whole buffer for every holder;
/// [`GpuStream::live_bytes`] counts device memory once, on the stream holding it.
#[derive(Clone)]
pub struct CudaTensor {
    buf: Arc<Buffer>,
    /// Where this handle's work goes; it has waited for the memory's writes.
    stream: Arc<GpuStream>,
    /// An event recorded on `stream` after the work that wrote this handle's data,
    /// when it was handed to another partition: a receiver waits on it rather than on
    /// everything its producer has enqueued since. Cleared by every write.
    ready: Option<Arc<CudaEvent>>,
    shape: Vec<usize>,
}

impl fmt::Debug for CudaTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaTensor")
            .field("shape", &self.shape)
            .field("device", &self.stream.gpu().name())
            .finish_non_exhaustive()
    }
}

fn numel(op: &'static str, shape: &[usize]) -> Result<usize, Error> {
    crate::storage::element_count(op, shape)
}

impl CudaTensor {
    /// A tensor of zeros at home on `stream`.
    pub fn zeros(stream: &Arc<GpuStream>, shape: &[usize]) -> Result<Self, Error> {
        let mut slice = stream.alloc(numel("CudaTensor::zeros", shape)?)?;
        if !slice.is_empty() {
            stream
                .cuda_stream()
                .memset_zeros(&mut slice)
                .map_err(driver)?;
        }
        Ok(CudaTensor::wrap(slice, stream, shape))
    }

    /// A tensor of `shape` from row-major host data, at home on `stream`.
    pub fn from_host(
        stream: &Arc<GpuStream>,
        shape: &[usize],
        data: &[f32],
    ) -> Result<Self, Error> {
        let len = numel("CudaTensor::from_host", shape)?;
        if len != data.len() {
            return Err(Error::Shape {
                op: "CudaTensor::from_host",
                expected: shape.to_vec(),
                got: vec![data.len()],
            });
        }
        let mut slice = stream.alloc(len)?;
        if len > 0 {
            stream
                .cuda_stream()
                .memcpy_htod(data, &mut slice)
                .map_err(driver)?;
        }
        Ok(CudaTensor::wrap(slice, stream, shape))
    }

    /// A copy of a host tensor, at home on `stream`.
    pub fn from_cpu(t: &CpuTensor, stream: &Arc<GpuStream>) -> Result<Self, Error> {
        CudaTensor::from_host(stream, t.shape(), &t.to_vec())
    }

    /// The elements, row-major, on the host (waits for the home stream).
    pub fn to_host(&self) -> Result<Vec<f32>, Error> {
        let mut out = vec![0.0f32; self.len()];
        if !out.is_empty() {
            let stream = self.stream.cuda_stream();
            stream
                .memcpy_dtoh(self.buf.slice(), &mut out)
                .map_err(driver)?;
            stream.synchronize().map_err(driver)?;
        }
        Ok(out)
    }

    /// A host copy (waits for the home stream).
    pub fn to_cpu(&self) -> Result<CpuTensor, Error> {
        CpuTensor::from_shape_vec(&self.shape, self.to_host()?)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.buf.slice().len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stream this tensor's work goes on.
    pub fn home(&self) -> &Arc<GpuStream> {
        &self.stream
    }

    /// The device memory, for reading on the home stream.
    pub fn slice(&self) -> &CudaSlice<f32> {
        self.buf.slice()
    }

    /// The device memory for writing on the home stream: copied first if shared; moved
    /// to the home stream first (after every other stream's reads) if it lives elsewhere.
    pub fn slice_mut(&mut self) -> Result<&mut CudaSlice<f32>, Error> {
        self.ready = None;
        let stream = self.stream.clone();
        match Arc::get_mut(&mut self.buf) {
            None => {
                let copy = copy_on(&stream, self.buf.slice())?;
                self.buf.read_on(&stream);
                self.buf = Arc::new(Buffer::new(copy, stream));
            }
            Some(buf) if !Arc::ptr_eq(&buf.home, &stream) => {
                let slice = buf.take_for(&stream)?;
                self.buf = Arc::new(Buffer::new(stream.adopt(slice), stream));
            }
            Some(buf) => buf.wait_for_readers(&stream)?,
        }
        let buf = Arc::get_mut(&mut self.buf).expect("unique after the copy or the move");
        Ok(buf.slice.as_mut().expect("present outside a move"))
    }

    /// The same tensor with the same shape reinterpreted (same element count).
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self, Error> {
        if numel("CudaTensor::reshape", shape)? != self.len() {
            return Err(Error::Shape {
                op: "CudaTensor::reshape",
                expected: self.shape.clone(),
                got: shape.to_vec(),
            });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// The tensor used on `stream` (same device): unchanged if already there; else
    /// `stream` waits for the tensor's data (its ready event from the hand-over, or
    /// everything enqueued so far on the old stream) and is recorded as a reader of the
    /// memory, which stays where it is until a write moves or copies it (see the type's
    /// documentation). No device memory is copied.
    pub fn on(self, stream: &Arc<GpuStream>) -> Result<Self, Error> {
        if Arc::ptr_eq(&self.stream, stream) {
            return Ok(self);
        }
        if self.stream.gpu().ordinal() != stream.gpu().ordinal() {
            return Err(Error::Cuda(format!(
                "CudaTensor::on: the tensor is on {} and the stream on {}; move it with \
                 to_device first",
                self.stream.gpu().name(),
                stream.gpu().name()
            )));
        }
        match &self.ready {
            Some(ready) => stream.wait_event(ready)?,
            None => stream.wait_for(&self.stream)?,
        }
        self.buf.read_on(stream);
        Ok(CudaTensor {
            buf: self.buf,
            stream: stream.clone(),
            ready: None,
            shape: self.shape,
        })
    }

    /// [`on`](CudaTensor::on) in place: for a layer's own tensors (parameters,
    /// statistics), which a caller may have replaced with tensors of another stream.
    pub(super) fn bring(&mut self, stream: &Arc<GpuStream>) -> Result<(), Error> {
        if !Arc::ptr_eq(&self.stream, stream) {
            *self = self.clone().on(stream)?;
        }
        Ok(())
    }

    pub(super) fn wrap(slice: CudaSlice<f32>, stream: &Arc<GpuStream>, shape: &[usize]) -> Self {
        CudaTensor {
            buf: Arc::new(Buffer::new(slice, stream.clone())),
            stream: stream.clone(),
            ready: None,
            shape: shape.to_vec(),
        }
    }

    /// Uninitialised memory of `shape` on `stream`, which the caller fills completely.
    pub(super) fn uninit(stream: &Arc<GpuStream>, shape: &[usize]) -> Result<Self, Error> {
        let slice = stream.alloc(numel("CudaTensor", shape)?)?;
        Ok(CudaTensor::wrap(slice, stream, shape))
    }

    /// Elements per sample (per index of the first dimension).
    fn per_row(&self) -> usize {
        self.shape[1..].iter().product()
    }
}

/// A copy of `src` (same device, readable on `stream`) made on `stream`.
fn copy_on(stream: &Arc<GpuStream>, src: &CudaSlice<f32>) -> Result<CudaSlice<f32>, Error> {
    let mut dst = stream.alloc(src.len())?;
    if !src.is_empty() {
        stream
            .cuda_stream()
            .memcpy_dtod(src, &mut dst)
            .map_err(driver)?;
    }
    Ok(dst)
}

impl Tensor for CudaTensor {
    fn batch_len(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }

    fn split(&self, sizes: &[usize]) -> Result<Vec<Self>, Error> {
        let len = self.batch_len();
        let total = sizes.iter().try_fold(0usize, |t, &s| t.checked_add(s));
        if self.shape.is_empty() || total != Some(len) {
            return Err(Error::SplitSizes {
                sizes: sizes.to_vec(),
                len,
            });
        }
        let (stream, per_row) = (self.stream.clone(), self.per_row());
        self.buf.read_on(&stream);
        let mut start = 0;
        let mut parts = Vec::with_capacity(sizes.len());
        for &rows in sizes {
            let mut shape = self.shape.clone();
            shape[0] = rows;
            let count = rows * per_row;
            let mut dst = stream.alloc(count)?;
            if count > 0 {
                let src = self.buf.slice().slice(start..start + count);
                stream
                    .cuda_stream()
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(driver)?;
            }
            start += count;
            parts.push(CudaTensor::wrap(dst, &stream, &shape));
        }
        Ok(parts)
    }

    fn concat(parts: Vec<Self>) -> Result<Self, Error> {
        let first = parts.first().ok_or(Error::NothingToConcat)?;
        let (stream, shape0) = (first.stream.clone(), first.shape.clone());
        if shape0.is_empty() {
            return Err(Error::Shape {
                op: "concat",
                expected: vec![0],
                got: shape0,
            });
        }
        if let Some(bad) = parts
            .iter()
            .find(|p| p.shape.len() != shape0.len() || p.shape[1..] != shape0[1..])
        {
            return Err(Error::Shape {
                op: "concat",
                expected: shape0,
                got: bad.shape.clone(),
            });
        }
        let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
        let mut shape = shape0;
        shape[0] = rows;
        let mut out = stream.alloc(numel("concat", &shape)?)?;
        let mut start = 0;
        for part in parts {
            let ordinal = stream.gpu().ordinal();
            let part = if part.stream.gpu().ordinal() == ordinal {
                part.on(&stream)?
            } else {
                part.to_device(&Device::Cuda(ordinal))?.on(&stream)?
            };
            let count = part.len();
            if count > 0 {
                let mut dst = out.slice_mut(start..start + count);
                stream
                    .cuda_stream()
                    .memcpy_dtod(part.buf.slice(), &mut dst)
                    .map_err(driver)?;
            }
            start += count;
        }
        Ok(CudaTensor::wrap(out, &stream, &shape))
    }

    fn size_bytes(&self) -> usize {
        self.len() * 4
    }

    fn accumulate(&mut self, other: &Self) -> Result<(), Error> {
        if self.shape != other.shape {
            return Err(Error::Shape {
                op: "accumulate",
                expected: self.shape.clone(),
                got: other.shape.clone(),
            });
        }
        let stream = self.stream.clone();
        let ordinal = stream.gpu().ordinal();
        if other.stream.gpu().ordinal() != ordinal {
            let moved = other.clone().to_device(&Device::Cuda(ordinal))?;
            return self.accumulate(&moved.on(&stream)?);
        }
        let n = self.len() as u64;
        if n == 0 {
            return Ok(());
        }
        // Read `other` here: wait for its stream, and record the read so its memory is
        // neither freed nor overwritten before it.
        match &other.ready {
            Some(ready) => stream.wait_event(ready)?,
            None => stream.wait_for(&other.stream)?,
        }
        other.buf.read_on(&stream);
        let gpu = stream.gpu().clone();
        let cfg = gpu.elementwise(self.len());
        let y = self.slice_mut()?;
        let mut launch = stream.cuda_stream().launch_builder(&gpu.kernels().add);
        launch.arg(y).arg(other.buf.slice()).arg(&n);
        // SAFETY: `pp_add(float* y, const float* x, u64 n)`: both buffers hold `n` f32
        // (equal shapes); `y` is this tensor's own unique memory at home on `stream`
        // (`slice_mut`), and `other`'s is readable there: `stream` waited for `other`'s
        // stream above, and its home will wait for `stream` before freeing or overwriting
        // it (`read_on`). If `y` and `other` were one buffer, `slice_mut` copied `y` first.
        unsafe { launch.launch(cfg) }.map(drop).map_err(driver)
    }

    fn to_device(self, device: &Device) -> Result<Self, Error> {
        let Device::Cuda(ordinal) = *device else {
            return Err(Error::Device {
                tensor: "CudaTensor",
                device: *device,
            });
        };
        if self.stream.gpu().ordinal() == ordinal {
            // The hand-over to another partition of this device: mark the data ready
            // here, on the producer's thread right after its work was enqueued, so the
            // receiver does not wait for what the producer enqueues next.
            let mut t = self;
            if t.ready.is_none() {
                t.ready = Some(Arc::new(t.stream.event()?));
            }
            return Ok(t);
        }
        let target = Gpu::new(ordinal)?.transfer_stream()?;
        let mut dst = target.alloc(self.len())?;
        if !self.is_empty() {
            // A peer copy after everything enqueued on the old stream (an event of the
            // other device's context: the driver allows waiting on it); the driver stages
            // it through the host where peer access is off. The copy is a read on
            // `target`, which the memory's home waits for before freeing it.
            match &self.ready {
                Some(ready) => target.wait_event(ready)?,
                None => target.wait_for(&self.stream)?,
            }
            self.buf.read_on(&target);
            target
                .cuda_stream()
                .memcpy_dtod(self.buf.slice(), &mut dst)
                .map_err(driver)?;
        }
        Ok(CudaTensor::wrap(dst, &target, &self.shape))
    }
}
