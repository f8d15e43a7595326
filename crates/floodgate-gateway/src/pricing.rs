//! The price table: what a response spends, priced per model from its usage, for budgets (spend
//! caps per scope per UTC day or month, docs/design.md §6).
//!
//! - Before admission, a request whose chain has budgets reads their spend (charging nothing):
//!   one that has reached its cap is refused with 429 `insufficient_quota` until its period
//!   ends, and no rate limit is charged (`http::admission`).
//! - After the response, its spend is priced from its usage with the [`Prices`] table and added
//!   to every budget of the chain once, never replayed (`charge`).
//!
//! Money is integers: prices in pico-USD per token, spend in micro-USD, rounded up per response.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};

use crate::config::{ANY_MODEL, PriceConfig};
use crate::openai::usage::TokenUsage;

/// What one model's tokens cost, in pico-USD per token (USD per million tokens × 10^6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Price {
    /// Per input (prompt) token.
    pub input_pico: u64,
    /// Per output (completion) token.
    pub output_pico: u64,
}

impl Price {
    /// The cost of `usage` in micro-USD, rounded up: input tokens at the input price, output
    /// tokens at the output price; usage that only gives a total is charged it at the output
    /// price (the dearer one, for every model priced today).
    pub fn cost(&self, usage: &TokenUsage) -> u64 {
        let pico = match (usage.input, usage.output) {
            // A product of two u64 fits a u128; their sum may not (the upstream's numbers and
            // prices can be anything), so it saturates.
            (None, None) => u128::from(usage.total) * u128::from(self.output_pico),
            (input, output) => (u128::from(input.unwrap_or(0)) * u128::from(self.input_pico))
                .saturating_add(u128::from(output.unwrap_or(0)) * u128::from(self.output_pico)),
        };
        u64::try_from(pico.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

/// The price table: models by exact name, the `*` fallback, and the models already warned
/// about as unpriced.
#[derive(Debug, Default)]
pub struct Prices {
    by_model: HashMap<String, Price>,
    /// The length of the longest priced name: no longer prefix of a model can match.
    longest: usize,
    fallback: Option<Price>,
    warned: Mutex<HashSet<String>>,
}

/// How many unpriced models are warned about, each once; past that, one last warning says so.
/// A request names its own model (used when the response names none), so a caller could
/// otherwise grow the set, and the log, without bound.
const MAX_WARNED: usize = 256;

impl Prices {
    /// The table of `[[prices]]`.
    pub fn new(prices: &[PriceConfig]) -> Prices {
        let mut by_model = HashMap::new();
        let mut fallback = None;
        for p in prices {
            let price = Price {
                input_pico: p.input_pico,
                output_pico: p.output_pico,
            };
            if p.model == ANY_MODEL {
                fallback = Some(price);
            } else {
                by_model.insert(p.model.clone(), price);
            }
        }
        Prices {
            longest: by_model.keys().map(String::len).max().unwrap_or(0),
            by_model,
            fallback,
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// The price of `model`: its own (see [`Prices::specific`]), else the `*` price.
    pub fn lookup(&self, model: &str) -> Option<Price> {
        self.specific(model).or(self.fallback)
    }

    /// The price `model` has by name, not by `*`: its own entry; else, named under a provider
    /// (`openai/gpt-4o`, as routers name models), the entry of what follows its last `/`; else
    /// that of the longest priced name that prefixes it at a `-` (`gpt-4o-mini-2024-07-18` is
    /// priced as `gpt-4o-mini`), the whole name's first, then what follows its last `/`. An
    /// exact name thus beats a prefix: `openai/gpt-4o-mini` is a `gpt-4o-mini`, not an
    /// `openai/gpt-4o`.
    pub fn specific(&self, model: &str) -> Option<Price> {
        let bare = model.rsplit_once('/').map(|(_, name)| name);
        self.by_model
            .get(model)
            .or_else(|| bare.and_then(|name| self.by_model.get(name)))
            .copied()
            .or_else(|| self.by_prefix(model))
            .or_else(|| bare.and_then(|name| self.by_prefix(name)))
    }

    /// The price of the longest priced name that prefixes `model` at a `-`.
    fn by_prefix(&self, model: &str) -> Option<Price> {
        // Longest first: cut at the last `-` that could end a priced name, then the one before,
        // ... Only dashes within the longest priced name's length can (the model is the
        // caller's text when the response names none: a long one must not cost a lookup per
        // dash). A `-` is one byte, so a cut there is always a char boundary.
        let bytes = model.as_bytes();
        let mut end = bytes.len().min(self.longest + 1);
        while let Some(dash) = bytes[..end].iter().rposition(|&b| b == b'-') {
            if let Some(p) = self.by_model.get(&model[..dash]) {
                return Some(*p);
            }
            end = dash;
        }
        None
    }

    /// The spend of a response with `usage`, in micro-USD, priced as the model the response
    /// names (`response`) by its own price. A response that names a model the table does not
    /// price by name (an upstream answering with a deployment's name) is priced as the model
    /// the request named or by `*`, whichever costs more: the request's model is the caller's
    /// text, and the upstream may not have run it, so it can raise a spend, never lower it. A
    /// response that names no model is priced as the request's, else by `*`. Nothing priced:
    /// it spends nothing, with a warning logged once per model.
    pub fn spend(&self, response: Option<&str>, request: Option<&str>, usage: &TokenUsage) -> u64 {
        let requested = || request.and_then(|m| self.specific(m));
        let price = match response {
            Some(m) => self.specific(m).map(|p| p.cost(usage)).or_else(|| {
                [requested(), self.fallback]
                    .into_iter()
                    .flatten()
                    .map(|p| p.cost(usage))
                    .max()
            }),
            None => requested().or(self.fallback).map(|p| p.cost(usage)),
        };
        match price {
            Some(micro_usd) => micro_usd,
            None => {
                let name = response.or(request).unwrap_or("(no model named)");
                let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
                if warned.len() < MAX_WARNED && !warned.contains(name) {
                    warned.insert(name.to_owned());
                    tracing::warn!(
                        model = name,
                        "no [[prices]] entry prices this model (and no `*`): its responses spend nothing against budgets"
                    );
                    if warned.len() == MAX_WARNED {
                        tracing::warn!(
                            "{MAX_WARNED} unpriced models warned about: no more such warnings"
                        );
                    }
                }
                0
            }
        }
    }

    /// Every price, exact names sorted, then `*` (for `check-config`).
    pub fn list(&self) -> Vec<(&str, Price)> {
        let mut out: Vec<(&str, Price)> = self
            .by_model
            .iter()
            .map(|(m, p)| (m.as_str(), *p))
            .collect();
        out.sort_by_key(|(m, _)| *m);
        if let Some(p) = self.fallback {
            out.push((ANY_MODEL, p));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn price(model: &str, input: u64, output: u64) -> PriceConfig {
        PriceConfig {
            model: model.into(),
            input_pico: input,
            output_pico: output,
        }
    }

    fn usage(input: Option<u64>, output: Option<u64>, total: u64) -> TokenUsage {
        TokenUsage {
            input,
            output,
            total,
        }
    }

    #[test]
    fn models_match_exactly_then_by_the_longest_dash_prefix_then_star() {
        let p = Prices::new(&[
            price("gpt-4o", 2_500_000, 10_000_000),
            price("gpt-4o-mini", 150_000, 600_000),
            price("*", 1, 2),
        ]);
        assert_eq!(p.lookup("gpt-4o-mini").unwrap().input_pico, 150_000);
        assert_eq!(
            p.lookup("gpt-4o-mini-2024-07-18").unwrap().input_pico,
            150_000
        );
        assert_eq!(p.lookup("gpt-4o-2024-08-06").unwrap().input_pico, 2_500_000);
        // Not at a `-` boundary: `gpt-4omni` is not a `gpt-4o`.
        assert_eq!(p.lookup("gpt-4omni").unwrap().input_pico, 1);
        assert_eq!(p.lookup("claude").unwrap().input_pico, 1);
        // A model far longer than any priced name, all dashes: no lookup per dash.
        let long = "gpt-4o-mini-".repeat(100_000);
        assert_eq!(p.lookup(&long).unwrap().input_pico, 150_000);
        assert_eq!(p.lookup(&"-".repeat(1_000_000)).unwrap().input_pico, 1);
        assert_eq!(p.lookup("é-gpt-4o").unwrap().input_pico, 1);
        let no_star = Prices::new(&[price("gpt-4o", 1, 1)]);
        assert_eq!(no_star.lookup("o1"), None);
        assert_eq!(
            no_star.spend(Some("o1"), None, &usage(Some(5), Some(5), 10)),
            0
        );
        assert_eq!(no_star.spend(None, None, &usage(Some(5), Some(5), 10)), 0);
        for i in 0..1_000 {
            no_star.spend(Some(&format!("m{i}")), None, &usage(None, None, 1));
        }
        assert_eq!(no_star.warned.lock().unwrap().len(), MAX_WARNED);
    }

    #[test]
    fn a_provider_named_model_is_priced_by_its_name_after_the_last_slash() {
        let p = Prices::new(&[
            price("gpt-4o", 2_500_000, 10_000_000),
            price("gpt-4o-mini", 150_000, 600_000),
            price("*", 1, 2),
        ]);
        assert_eq!(p.lookup("openai/gpt-4o").unwrap().input_pico, 2_500_000);
        assert_eq!(
            p.lookup("azure/openai/gpt-4o-mini-2024-07-18")
                .unwrap()
                .input_pico,
            150_000
        );
        // An entry that names the provider wins over the name after it.
        let named = Prices::new(&[price("gpt-4o", 2, 2), price("openai/gpt-4o", 3, 3)]);
        assert_eq!(named.lookup("openai/gpt-4o").unwrap().input_pico, 3);
        assert_eq!(named.lookup("other/gpt-4o").unwrap().input_pico, 2);
        // An exact name beats a prefix: the provider's `gpt-4o` is no `gpt-4o-mini`.
        let both = Prices::new(&[price("openai/gpt-4o", 3, 3), price("gpt-4o-mini", 4, 4)]);
        assert_eq!(both.lookup("openai/gpt-4o-mini").unwrap().input_pico, 4);
        assert_eq!(
            both.lookup("openai/gpt-4o-2024-08-06").unwrap().input_pico,
            3
        );
        assert_eq!(
            both.lookup("azure/gpt-4o-mini-2024-07-18")
                .unwrap()
                .input_pico,
            4
        );
        assert_eq!(p.lookup("openai/").unwrap().input_pico, 1);
    }

    #[test]
    fn an_answer_naming_an_unpriced_model_is_priced_as_the_request_named_or_by_star_if_dearer() {
        let p = Prices::new(&[
            price("gpt-4o", 1_000_000, 1_000_000),
            price("gpt-4o-mini", 1, 1),
            price("*", 100_000, 100_000),
        ]);
        let u = usage(Some(10), Some(10), 20);
        // Priced by name: the response's own price, whatever the request asked.
        assert_eq!(p.spend(Some("gpt-4o-2024-08-06"), Some("x"), &u), 20);
        assert_eq!(p.spend(Some("gpt-4o-mini"), Some("gpt-4o"), &u), 1);
        // Unpriced by name: the request's model when it costs more than `*`...
        assert_eq!(p.spend(Some("deployment-7"), Some("gpt-4o"), &u), 20);
        // ... but never less: a cheap model asked cannot lower what an unknown one spends.
        assert_eq!(p.spend(Some("o1-2024-12-17"), Some("gpt-4o-mini"), &u), 2);
        assert_eq!(p.spend(Some("deployment-7"), Some("other"), &u), 2);
        // No model in the response: the request's, then `*`.
        assert_eq!(p.spend(None, Some("gpt-4o-mini"), &u), 1);
        assert_eq!(p.spend(None, Some("other"), &u), 2);
        let no_star = Prices::new(&[price("gpt-4o", 1_000_000, 1_000_000)]);
        assert_eq!(no_star.spend(Some("deployment-7"), Some("gpt-4o"), &u), 20);
        assert_eq!(no_star.spend(Some("deployment-7"), Some("o1"), &u), 0);
        // The warning names what the response called it.
        assert!(no_star.warned.lock().unwrap().contains("deployment-7"));
    }

    #[test]
    fn costs_are_exact_integers_rounded_up() {
        // 0.15 and 0.60 USD per million tokens.
        let mini = Price {
            input_pico: 150_000,
            output_pico: 600_000,
        };
        // 100 * 0.15 + 100 * 0.6 = 75 µUSD exactly (in floating point 0.15 * 100 is not 15).
        assert_eq!(mini.cost(&usage(Some(100), Some(100), 200)), 75);
        // 1 input token: 0.15 µUSD, rounded up to 1.
        assert_eq!(mini.cost(&usage(Some(1), None, 1)), 1);
        // Only a total: charged at the output price.
        assert_eq!(mini.cost(&usage(None, None, 1_000)), 600);
        assert_eq!(mini.cost(&usage(None, None, 0)), 0);
        let huge = Price {
            input_pico: u64::MAX,
            output_pico: u64::MAX,
        };
        assert_eq!(
            huge.cost(&usage(Some(u64::MAX), Some(u64::MAX), 0)),
            u64::MAX
        );
    }
}
