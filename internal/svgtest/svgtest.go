// Package svgtest is the tests' reading of the SVG charts package bench
// writes (bench's own tests, and internal/benchgpu's of the throughput
// chart): it checks a document is well-formed with an <svg> root and
// hands back its elements by name. It keeps no state.
package svgtest

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"

	"github.com/stretchr/testify/require"
)

// Parse checks that b is well-formed XML with an <svg> root and returns
// the elements by name.
func Parse(t require.TestingT, b []byte) map[string][]xml.StartElement {
	d := xml.NewDecoder(bytes.NewReader(b))
	els := map[string][]xml.StartElement{}
	root := ""
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		if se, ok := tok.(xml.StartElement); ok {
			if root == "" {
				root = se.Name.Local
			}
			els[se.Name.Local] = append(els[se.Name.Local], se)
		}
	}
	require.Equal(t, "svg", root)
	return els
}

// Attr returns se's attribute name ("" when it has none).
func Attr(se xml.StartElement, name string) string {
	for _, a := range se.Attr {
		if a.Name.Local == name {
			return a.Value
		}
	}
	return ""
}
