//! One memory-mapped safetensors file.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::dtype::Dtype;
use crate::error::{io_error, Error, Result};
use crate::header::{parse_header, Header, TensorInfo};

/// A borrowed view of one tensor's bytes inside a map.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// The tensor's key.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: &'a [usize],
    /// The raw little-endian bytes, straight from the page cache.
    pub data: &'a [u8],
}

/// A safetensors file mapped into memory together with its validated header.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    /// The open file, for positioned reads beside the map.
    file: File,
    map: Mmap,
    header: Header,
}

impl SafetensorsFile {
    /// Maps `path` and validates its header; tensor data is not read until used.
    ///
    /// # The memory-map contract
    ///
    /// The file must not be modified or truncated while this value (or any
    /// view or MLX array made from it) is alive. Views read the file's pages
    /// directly: a concurrent writer changes them underneath, and truncation
    /// makes reading them fault (SIGBUS). Model files are written once and
    /// replaced by rename, which is safe: the map keeps the old file alive.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened or mapped;
    /// [`Error::Header`] when its header is invalid.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(io_error(&path))?;
        let meta = file.metadata().map_err(io_error(&path))?;
        if !meta.is_file() {
            // Mapping a directory or a device fails with an obscure OS
            // message ("No such device"); say what is wrong instead.
            return Err(Error::NotAFile { path });
        }
        // SAFETY: mapping is sound as long as the file is not changed while
        // mapped; that contract is the caller's, stated above. The map is
        // read-only, so we never write through it.
        let map = unsafe { Mmap::map(&file) }.map_err(io_error(&path))?;
        let header = parse_header(&map, map.len() as u64).map_err(|source| Error::Header {
            path: path.clone(),
            source,
        })?;
        Ok(SafetensorsFile {
            path,
            file,
            map,
            header,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file (e.g. for positioned reads or mappings of parts of it).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// A view of the tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.header.tensor(name).map(|info| self.view(info))
    }

    /// Lets the OS drop the pages of tensor `name` from this process's
    /// resident memory, for a caller that has copied the tensor out (e.g.
    /// into an MLX array on the CPU backend, which always copies). The pages
    /// stay in the page cache, and reading them again faults them back in
    /// from the file, so views stay valid. Without this, a model loaded
    /// through the map counts twice in the peak resident memory: once as
    /// the copies, once as the mapped pages read to make them.
    ///
    /// Returns whether the advice was given: `false` for an unknown name,
    /// and always on systems without `madvise` (non-Unix).
    pub fn release(&self, name: &str) -> bool {
        let Some(info) = self.header.tensor(name) else {
            return false;
        };
        let start = self.header.data_start() + info.data_offsets.0;
        let len = info.data_offsets.1 - info.data_offsets.0;
        if len == 0 {
            return false;
        }
        #[cfg(unix)]
        {
            // SAFETY: the map is read-only and backed by the file, so
            // MADV_DONTNEED discards nothing that cannot be read back: a later
            // access faults the same bytes in from the file (the map's
            // contract says the file does not change). The range is inside
            // the map: parse_header checked every offset against its length.
            let advised = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
            };
            advised.is_ok()
        }
        #[cfg(not(unix))]
        {
            let _ = start;
            false
        }
    }

    /// A copy of tensor `name`'s bytes, read with positioned reads rather
    /// than through the map: the pages go through the page cache but never
    /// into this process's resident set (what a caller that copies every
    /// tensor once, such as a fuse writing a new model, wants). `None` for
    /// an unknown name.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when the read fails (e.g. the file was
    /// truncated, which the memory-map contract forbids but a reader can
    /// still meet).
    pub fn read_tensor(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let Some(info) = self.header.tensor(name) else {
            return Ok(None);
        };
        let offset = (self.header.data_start() + info.data_offsets.0) as u64;
        let mut bytes = vec![0u8; info.byte_len()];
        read_exact_at(&self.file, &mut bytes, offset).map_err(io_error(&self.path))?;
        Ok(Some(bytes))
    }

    /// Rows `rows` of tensor `name` (slices along its outermost dimension),
    /// read with positioned reads like [`read_tensor`](Self::read_tensor):
    /// a few rows of a large table (an embedding looked up per token) are
    /// read without the table, or the pages around the rows, entering this
    /// process's resident set. `None` for an unknown name.
    ///
    /// # Errors
    /// [`Error::RowsOutOfRange`] when `rows` is not inside the tensor's
    /// outermost dimension (a scalar has none); [`Error::Io`] naming the file
    /// when the read fails.
    pub fn read_rows(&self, name: &str, rows: Range<usize>) -> Result<Option<Vec<u8>>> {
        let Some((offset, len)) = self.rows_at(name, rows)? else {
            return Ok(None);
        };
        let mut bytes = vec![0u8; len];
        read_exact_at(&self.file, &mut bytes, offset).map_err(io_error(&self.path))?;
        Ok(Some(bytes))
    }

    /// Rows `rows` of tensor `name` read into `out`, as
    /// [`read_rows`](Self::read_rows) reads them, for a caller that owns
    /// the destination (a buffer of an array library) and would otherwise
    /// hold the rows twice. `false` for an unknown name.
    ///
    /// # Errors
    /// As [`read_rows`](Self::read_rows), and [`Error::BufferLength`] when
    /// `out` is not exactly the rows' byte length.
    pub fn read_rows_into(&self, name: &str, rows: Range<usize>, out: &mut [u8]) -> Result<bool> {
        let Some((offset, len)) = self.rows_at(name, rows)? else {
            return Ok(false);
        };
        if out.len() != len {
            return Err(Error::BufferLength {
                path: self.path.clone(),
                key: name.to_owned(),
                expected: len,
                actual: out.len(),
            });
        }
        read_exact_at(&self.file, out, offset).map_err(io_error(&self.path))?;
        Ok(true)
    }

    /// Tells the system that this file's positioned reads land at scattered
    /// places (a mixture of experts' routed experts), so that a read fetches
    /// from storage what it asks for and nothing after it: Linux's
    /// `posix_fadvise(POSIX_FADV_RANDOM)`, macOS's `fcntl(F_RDAHEAD, 0)`.
    /// Under a memory limit, bytes read ahead that no read asks for evict
    /// cached bytes that the next reads do ask for. Returns whether the
    /// system took the advice (`false` on others).
    pub fn advise_random_reads(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: advice on an open descriptor this value owns; it
            // changes how the kernel reads ahead, not what reads return.
            unsafe {
                libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) == 0
            }
        }
        #[cfg(target_os = "macos")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: as above: `F_RDAHEAD` 0 turns read-ahead off for this
            // descriptor and nothing else.
            unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_RDAHEAD, 0) != -1 }
        }
        #[cfg(not(any(target_os = "linux", target_os = "macos")))]
        {
            false
        }
    }

    /// Tells the system that rows `rows` of tensor `name` will be read
    /// soon, so that it starts fetching them from storage now and a read
    /// that follows finds them cached: Linux's
    /// `posix_fadvise(POSIX_FADV_WILLNEED)`, macOS's `fcntl(F_RDADVISE)`.
    /// Returns whether the advice was given (`false` on other systems and
    /// for an unknown name).
    ///
    /// # Errors
    /// [`Error::RowsOutOfRange`] when `rows` is not inside the tensor's
    /// outermost dimension.
    pub fn advise_will_read(&self, name: &str, rows: Range<usize>) -> Result<bool> {
        let Some((offset, len)) = self.rows_at(name, rows)? else {
            return Ok(false);
        };
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: advice on an open descriptor this value owns, for a
            // range inside the file; it starts reads into the page cache
            // and changes nothing a read returns.
            Ok(unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    offset as libc::off_t,
                    len as libc::off_t,
                    libc::POSIX_FADV_WILLNEED,
                ) == 0
            })
        }
        #[cfg(target_os = "macos")]
        {
            use std::os::fd::AsRawFd;
            let advice = libc::radvisory {
                ra_offset: offset as libc::off_t,
                ra_count: i32::try_from(len).unwrap_or(i32::MAX),
            };
            // SAFETY: as above; `F_RDADVISE` reads the struct and starts
            // reading that range ahead.
            Ok(unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_RDADVISE, &advice) != -1 })
        }
        #[cfg(not(any(target_os = "linux", target_os = "macos")))]
        {
            let _ = (offset, len);
            Ok(false)
        }
    }

    /// Where rows `rows` of `name` lie in the file: offset and byte length.
    fn rows_at(&self, name: &str, rows: Range<usize>) -> Result<Option<(u64, usize)>> {
        let Some(info) = self.header.tensor(name) else {
            return Ok(None);
        };
        let len = info.shape.first().copied().unwrap_or(0);
        if rows.start > rows.end || rows.end > len {
            return Err(Error::RowsOutOfRange {
                path: self.path.clone(),
                key: name.to_owned(),
                rows,
                len,
            });
        }
        // The header check made the byte length the product of the shape
        // and the element size, so it divides into whole rows.
        let row_bytes = info.byte_len().checked_div(len).unwrap_or(0);
        let offset = self.header.data_start() + info.data_offsets.0 + rows.start * row_bytes;
        Ok(Some((offset as u64, rows.len() * row_bytes)))
    }

    /// Views of every tensor, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.header.tensors().iter().map(|info| self.view(info))
    }

    fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        let start = self.header.data_start() + info.data_offsets.0;
        let end = self.header.data_start() + info.data_offsets.1;
        TensorView {
            name: &info.name,
            dtype: info.dtype,
            shape: &info.shape,
            // In range: parse_header checked every offset against the file length.
            data: &self.map[start..end],
        }
    }
}

/// Fills `buf` from `file` at `offset` without moving a shared cursor, so
/// that threads may read one open file at once.
pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        let (mut buf, mut offset) = (buf, offset);
        while !buf.is_empty() {
            match std::os::windows::fs::FileExt::seek_read(file, buf, offset)? {
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                n => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
            }
        }
        Ok(())
    }
}
