//! Workspace-wide integration tests; the tests are the `[[test]]` targets
//! beside this file. This library is empty on purpose.

/// Compiles the workspace README's tour with the doc-tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
