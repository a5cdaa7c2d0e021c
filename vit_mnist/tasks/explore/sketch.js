// The explorer's Draw tab (vit_mnist/tasks/explore/): Gradio's HTML component runs this with
// `element` (the component's HTML: a canvas and a Clear button) and `trigger`. At the
// pointer's release the drawing goes with the event, as one PNG data URL; Clear sends none.
const canvas = element.querySelector('canvas');
const ink = canvas.getContext('2d');
Object.assign(ink, {
  lineWidth: Number(canvas.dataset.ink), lineCap: 'round', lineJoin: 'round', strokeStyle: '#000',
});
let drawing = false;
// Canvas pixels from the pointer's page position (the canvas may be drawn scaled).
const at = (e) => {
  const box = canvas.getBoundingClientRect();
  return [(e.clientX - box.left) * canvas.width / box.width,
          (e.clientY - box.top) * canvas.height / box.height];
};
canvas.addEventListener('pointerdown', (e) => {
  drawing = true;
  canvas.setPointerCapture(e.pointerId);
  ink.beginPath(); ink.moveTo(...at(e)); ink.lineTo(...at(e)); ink.stroke();
});
canvas.addEventListener('pointermove', (e) => {
  if (drawing) { ink.lineTo(...at(e)); ink.stroke(); }
});
const release = () => {
  if (!drawing) return;
  drawing = false;
  trigger('input', {png: canvas.toDataURL('image/png')});
};
canvas.addEventListener('pointerup', release);
canvas.addEventListener('pointercancel', release);
element.querySelector('button').addEventListener('click', () => {
  ink.clearRect(0, 0, canvas.width, canvas.height);
  trigger('input', {png: null});
});
