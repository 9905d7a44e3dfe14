//! Workspace-wide integration tests; the tests are the `[[test]]` targets
//! beside this file. This library is empty on purpose.
