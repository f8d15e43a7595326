//! Money: how amounts of USD are printed, and the largest amounts a config takes.
//!
//! Budgets are kept in micro-USD and prices in pico-USD per token, both integers, so that a
//! cost is exact; these print them back as the dollars a config is written in.

/// `micros` micro-USD as dollars: `$25.00`, `$0.000150`.
pub fn usd(micros: u64) -> String {
    let (whole, frac) = (micros / 1_000_000, micros % 1_000_000);
    if frac % 10_000 == 0 {
        format!("${whole}.{:02}", frac / 10_000)
    } else {
        format!("${whole}.{frac:06}")
    }
}

/// A price per token in pico-USD as USD per million tokens: `0.15`, `2.5`.
pub fn per_million(pico: u64) -> String {
    let (whole, frac) = (pico / 1_000_000, pico % 1_000_000);
    let frac = format!("{frac:06}");
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        format!("{whole}")
    } else {
        format!("{whole}.{frac}")
    }
}

/// The largest `usd` a budget takes: about 2^53 micro-USD is the most a period counter holds.
pub const MAX_BUDGET_USD: f64 = 1e9;
/// The largest price per million tokens taken.
pub const MAX_PRICE_PER_MILLION: f64 = 1e6;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_print_as_a_config_writes_them() {
        // Cents unless the amount is finer; prices without trailing zeros.
        let dollars = [
            (25_000_000, "$25.00"),
            (1_230_000, "$1.23"),
            (150, "$0.000150"),
        ];
        for (micros, shown) in dollars {
            assert_eq!(usd(micros), shown);
        }
        let prices = [
            (150_000, "0.15"),
            (2_500_000, "2.5"),
            (10_000_000, "10"),
            (1, "0.000001"),
        ];
        for (pico, shown) in prices {
            assert_eq!(per_million(pico), shown);
        }
    }
}
