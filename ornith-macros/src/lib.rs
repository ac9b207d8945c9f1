//! Turns the model spec into the typed model graph.
