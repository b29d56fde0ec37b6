//! The IO layer.
