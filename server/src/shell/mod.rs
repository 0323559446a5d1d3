//! The shell: the configuration, the route table, the listeners and the admin endpoints; it
//! composes the capabilities and may import anything.

pub(crate) mod admin;
pub mod app;
pub mod config;
#[cfg(test)]
mod floors;
#[cfg(test)]
mod fuzz;
pub mod inject;
pub mod relocate;
pub(crate) mod serve;
pub(crate) mod state;
