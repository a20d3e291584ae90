//! Forward-mode dual numbers, so the reference loss is written once, literally, and
//! differentiated exactly rather than by hand-derived formulas.

use std::ops::{Add, Mul, Neg, Sub};

/// A scalar the reference loss can be evaluated in: f64, or [`Dual`] for derivatives.
pub trait Num:
    Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Neg<Output = Self>
{
    /// A constant (zero derivative).
    fn c(x: f64) -> Self;
    /// The value.
    fn v(self) -> f64;
    /// `exp(self)`.
    fn exp(self) -> Self;
    /// `1 / self`.
    fn recip(self) -> Self;
    /// The same value with zero derivative (autograd's `detach`).
    fn stopgrad(self) -> Self {
        Self::c(self.v())
    }
    /// `min(self, other)` by value, ties to `self` (autograd's branch choice).
    fn min_v(self, other: Self) -> Self {
        if self.v() <= other.v() { self } else { other }
    }
    /// `clamp(self, lo, hi)`: derivative 1 inside `[lo, hi]` (bounds included), else 0.
    fn clamp_v(self, lo: f64, hi: f64) -> Self {
        if self.v() < lo {
            Self::c(lo)
        } else if self.v() > hi {
            Self::c(hi)
        } else {
            self
        }
    }
}

impl Num for f64 {
    fn c(x: f64) -> Self {
        x
    }
    fn v(self) -> f64 {
        self
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn recip(self) -> Self {
        1.0 / self
    }
}

/// `v + d·ε` with `ε² = 0`: `d` carries the derivative along one seed direction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dual {
    /// Value.
    pub v: f64,
    /// Derivative.
    pub d: f64,
}

impl Add for Dual {
    type Output = Dual;
    fn add(self, o: Dual) -> Dual {
        Dual {
            v: self.v + o.v,
            d: self.d + o.d,
        }
    }
}
impl Sub for Dual {
    type Output = Dual;
    fn sub(self, o: Dual) -> Dual {
        Dual {
            v: self.v - o.v,
            d: self.d - o.d,
        }
    }
}
impl Mul for Dual {
    type Output = Dual;
    fn mul(self, o: Dual) -> Dual {
        Dual {
            v: self.v * o.v,
            d: self.d * o.v + self.v * o.d,
        }
    }
}
impl Neg for Dual {
    type Output = Dual;
    fn neg(self) -> Dual {
        Dual {
            v: -self.v,
            d: -self.d,
        }
    }
}

impl Num for Dual {
    fn c(x: f64) -> Self {
        Dual { v: x, d: 0.0 }
    }
    fn v(self) -> f64 {
        self.v
    }
    fn exp(self) -> Self {
        let e = self.v.exp();
        Dual {
            v: e,
            d: self.d * e,
        }
    }
    fn recip(self) -> Self {
        Dual {
            v: 1.0 / self.v,
            d: -self.d / (self.v * self.v),
        }
    }
}
