//! Helpers shared by the integration tests; each test file that needs them says `mod common;`
//! (and uses only some of them, hence `dead_code`).
#![allow(dead_code)]

use std::io::{BufRead, Read, Write};

/// `n` pseudo-random ids below 5,000 (an LCG; a fixed stream per `salt`).
pub fn ids(n: usize, salt: u64) -> Vec<u32> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ salt.wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % 5000) as u32
        })
        .collect()
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`): (status, body as sent).
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to ornith serve");
    s.set_read_timeout(Some(std::time::Duration::from_secs(300))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, rest) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP response: {out:?}"));
    (head.split(' ').nth(1).unwrap().parse().unwrap(), rest.to_string())
}

/// Reads `ornith serve`'s stderr until it says where it listens; the `host:port`.
pub fn listening_addr(lines: &mut std::io::Lines<impl BufRead>) -> String {
    loop {
        let l = lines.next().expect("ornith serve exited before listening").unwrap();
        if let Some((_, rest)) = l.split_once(" on http://") {
            return rest.split(';').next().unwrap().to_string();
        }
    }
}
