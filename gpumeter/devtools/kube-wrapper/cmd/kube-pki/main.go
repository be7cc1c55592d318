// kube-pki writes the certificates and keys a test kube-apiserver needs, with nothing but Go's standard library
// (the Python side has no X.509 library and must not depend on an openssl command):
//
//	ca.crt, ca.key               a self-signed CA (ECDSA P-256) that signs the rest; the client CA too
//	apiserver.crt, apiserver.key the serving certificate, for -hosts (IP addresses and DNS names)
//	admin.crt, admin.key         a client certificate, CN=gpumeter-test-admin, O=system:masters
//	sa.key, sa.pub               the service-account token signing key pair (ECDSA P-256, PKCS#8 / PKIX PEM)
//
// Usage: kube-pki -dir DIR [-hosts 127.0.0.1,localhost] [-validity 24h]. Private keys are written 0600.
package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

func main() {
	dir := flag.String("dir", "", "folder to write into (created)")
	hosts := flag.String("hosts", "127.0.0.1,localhost", "comma-separated IPs and DNS names of the serving certificate")
	validity := flag.Duration("validity", 24*time.Hour, "how long the certificates are valid")
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "kube-pki: -dir is required")
		os.Exit(2)
	}
	if err := run(*dir, strings.Split(*hosts, ","), *validity); err != nil {
		fmt.Fprintln(os.Stderr, "kube-pki:", err)
		os.Exit(1)
	}
}

func run(dir string, hosts []string, validity time.Duration) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	// Backdated a minute: a freshly started server must not see a certificate from its own future.
	notBefore := time.Now().Add(-time.Minute)
	notAfter := notBefore.Add(validity)

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTemplate := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "gpumeter-test-ca"},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTemplate, caTemplate, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	if err := writeCertAndKey(dir, "ca", caDER, caKey); err != nil {
		return err
	}

	serving := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, host := range hosts {
		host = strings.TrimSpace(host)
		if ip := net.ParseIP(host); ip != nil {
			serving.IPAddresses = append(serving.IPAddresses, ip)
		} else if host != "" {
			serving.DNSNames = append(serving.DNSNames, host)
		}
	}
	if err := issue(dir, "apiserver", serving, ca, caKey); err != nil {
		return err
	}

	admin := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "gpumeter-test-admin", Organization: []string{"system:masters"}},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if err := issue(dir, "admin", admin, ca, caKey); err != nil {
		return err
	}

	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	if err := writeKey(filepath.Join(dir, "sa.key"), saKey); err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644)
}

func issue(dir, name string, template, ca *x509.Certificate, caKey crypto.Signer) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.CreateCertificate(rand.Reader, template, ca, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	return writeCertAndKey(dir, name, der, key)
}

func writeCertAndKey(dir, name string, der []byte, key *ecdsa.PrivateKey) error {
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := os.WriteFile(filepath.Join(dir, name+".crt"), certPEM, 0o644); err != nil {
		return err
	}
	return writeKey(filepath.Join(dir, name+".key"), key)
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err)
	}
	return n
}
