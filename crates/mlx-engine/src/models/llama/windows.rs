//! Sliding-window layers in the llama family (gpt_oss's, and llama's own
//! when its `config.json` gives `layer_types`, as mlx_lm 0.32.2 reads them).

/// Which layers attend within a window, and the window: the latest
/// `size` positions, the query's own included.
#[derive(Debug, Clone)]
pub(super) struct Windows {
    pub size: i32,
    pub sliding: Vec<bool>,
}

impl Windows {
    /// Layer `i`'s window, if it has one.
    pub(super) fn of(&self, i: usize) -> Option<i32> {
        self.sliding
            .get(i)
            .copied()
            .unwrap_or(false)
            .then_some(self.size)
    }

    /// From `layer_types` (one per layer: `sliding_attention` or
    /// `full_attention`) and `sliding_window`: `None` where no layer
    /// slides; an error for a count or type mlx_lm would not run, or a
    /// sliding layer without a window.
    pub(super) fn of_layer_types(
        types: &[String],
        window: Option<usize>,
        layers: usize,
    ) -> std::result::Result<Option<Windows>, String> {
        if types.len() != layers {
            return Err(format!(
                "layer_types has {} entries for {layers} layers",
                types.len()
            ));
        }
        let sliding = types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(format!(
                    "layer type {other:?}: sliding_attention and full_attention are read"
                )),
            })
            .collect::<std::result::Result<Vec<bool>, String>>()?;
        if !sliding.contains(&true) {
            return Ok(None);
        }
        match window {
            Some(size) if size > 0 && size <= i32::MAX as usize => Ok(Some(Windows {
                size: size as i32,
                sliding,
            })),
            Some(size) => Err(format!("sliding_window {size} is out of range")),
            None => Err("sliding layers in layer_types and no sliding_window".into()),
        }
    }
}
