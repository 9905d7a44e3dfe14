//! Calls into mlx-c's distributed functions, with MLX's error message.
//!
//! mlx-rs registers one process-wide MLX error handler that keeps the last
//! message for its own wrappers, which cannot be read from outside mlx-rs.
//! Calls made here would leave their message there, to be reported later
//! against an unrelated operation. So a handler of ours is registered after
//! mlx-rs's: while a call of this module runs on a thread, that thread's
//! messages come here; every other message goes on to mlx-rs's handler
//! unchanged.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_void, CStr};
use std::sync::Once;

extern "C" {
    /// mlx-rs 0.33's error handler, exported unmangled by mlx-rs itself.
    fn default_mlx_error_handler(msg: *const c_char, data: *mut c_void);
}

thread_local! {
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
    static CAPTURED: RefCell<Option<String>> = const { RefCell::new(None) };
}

extern "C" fn handler(msg: *const c_char, data: *mut c_void) {
    if CAPTURING.with(Cell::get) {
        // SAFETY: MLX passes a NUL-terminated message valid for this call.
        let text = unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned();
        CAPTURED.with(|c| *c.borrow_mut() = Some(text));
    } else {
        // SAFETY: forwarded unchanged to the handler mlx-rs registered,
        // with the arguments MLX gave us.
        unsafe { default_mlx_error_handler(msg, data) }
    }
}

static INSTALL: Once = Once::new();

fn install() {
    INSTALL.call_once(|| {
        // Any guarded mlx-rs operation registers mlx-rs's handler first, so
        // that it cannot later replace ours.
        let _ = mlx_rs::ops::zeros::<f32>(&[1]);
        // SAFETY: `handler` is a plain function valid for the process's
        // life; no data pointer or destructor is passed.
        unsafe { mlx_sys::mlx_set_error_handler(Some(handler), std::ptr::null_mut(), None) };
    });
}

/// Runs `call` (an mlx-c function returning its status) and returns MLX's
/// message when it fails.
pub(super) fn checked(call: impl FnOnce() -> i32) -> Result<(), String> {
    install();
    CAPTURED.with(|c| c.borrow_mut().take());
    CAPTURING.with(|c| c.set(true));
    let status = call();
    CAPTURING.with(|c| c.set(false));
    let message = CAPTURED.with(|c| c.borrow_mut().take());
    match (status, message) {
        (0, None) => Ok(()),
        (_, Some(m)) => Err(m),
        (s, None) => Err(format!("mlx-c returned status {s}")),
    }
}
